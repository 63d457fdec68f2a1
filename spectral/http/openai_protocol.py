"""OpenAI-compatible request bodies (pydantic) and response builders."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spectral.sampling_params import (
    Count,
    Flag,
    GrammarText,
    InvalidRequestError,
    MinP,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    StopRegexes,
    StopTokenIds,
    Temperature,
    Text,
    TokenId,
    TopK,
    TopP,
    text,
)

# OpenAI's own ceiling on choices per request (the server's --max-request-sequences may be lower).
MAX_N = 128
MAX_MESSAGES = 4096
MAX_USER_CHARS = 256
# apply_chat_template's own arguments: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_ARGS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


# What {"type": "json_object"} asks for, as SGLang maps it: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema is what constrains the output."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: text(max_length=64) | None = None
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: Flag | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    include_usage: Flag = False


class CommonSampling(BaseModel):
    """What both completion routes take; fields OpenAI defines that spectral does not act on
    (`user`, `logit_bias` left empty, ...) are accepted and ignored, as OpenAI's SDKs send them."""

    model_config = ConfigDict(extra="ignore")

    model: text(max_length=256) | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: int = Field(1, strict=True, ge=1, le=MAX_N)
    stream: Flag = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: text(max_length=MAX_USER_CHARS) | None = None
    # SGLang extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: Flag = False
    min_tokens: Count = 0
    stop_token_ids: StopTokenIds | None = None
    stop_regex: StopRegexes | None = None
    no_stop_trim: Flag = False
    skip_special_tokens: Flag = True
    spaces_between_special_tokens: Flag = True
    # Structured output: OpenAI's response_format, or SGLang's grammar fields (at most one).
    response_format: ResponseFormat | None = None
    regex: GrammarText | None = None
    ebnf: GrammarText | None = None
    json_schema: GrammarText | None = None
    # SGLang extensions spectral does not act on: accepted while off, refused otherwise.
    lora_path: Any = Field(None, description="not supported: null only")
    return_hidden_states: Any = Field(None, description="not supported: null or false only")

    @field_validator("lora_path", "return_hidden_states")
    @classmethod
    def _unsupported(cls, value: Any) -> None:
        if value not in (None, False):
            raise ValueError("spectral does not support it; send null or leave it out")
        return None

    def grammar_fields(self) -> dict[str, str]:
        """The sampling parameters of the requested structure (none for text)."""
        out = {k: getattr(self, k) for k in ("regex", "ebnf", "json_schema") if getattr(self, k)}
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if out:
                raise InvalidRequestError(
                    f"response_format: give it or {', '.join(out)}, not both", "response_format"
                )
            if fmt.type == "json_object":
                out["json_schema"] = JSON_OBJECT_SCHEMA
            else:
                schema = fmt.json_schema.json_schema if fmt.json_schema else None
                out["json_schema"] = json.dumps(schema if schema is not None else {})
        return out

    def sampling_dict(self, max_tokens: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
            "min_new_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "stop_regex": self.stop_regex,
            "no_stop_trim": self.no_stop_trim,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
        }
        params |= self.grammar_fields()
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        for name in ("top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        return params


Prompt = (
    Text
    | Annotated[list[Text], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(CommonSampling):
    prompt: Prompt
    max_tokens: Count | None = 16
    echo: Flag = False
    logprobs: int | None = Field(default=None, strict=True, ge=0, le=20)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(CommonSampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: Flag = False
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=20)
    # SGLang: variables for the chat template (e.g. enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: Any = Field(None, description="not supported: null or false only")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(value or {}) & RESERVED_TEMPLATE_ARGS)
        if taken:
            raise ValueError(
                f"{', '.join(taken)} cannot be set here: only variables of the chat template"
            )
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _no_continuation(cls, value: Any) -> None:
        if value not in (None, False):
            raise ValueError("continuing the last assistant message is not supported; send false")
        return None


# ---- responses (for the OpenAPI document; the routes build plain dicts) ---------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def finish_reason(reason: dict[str, Any] | None) -> str | None:
    """OpenAI's names: stop for EOS/stop ids/stop strings, length, and abort as stop."""
    if reason is None:
        return None
    return "length" if reason["type"] == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
