"""The native API's request and response bodies (pydantic), the limits every request is held
to, and the error body all routes share.

The models state types and hard bounds (the OpenAPI document is generated from them);
`RequestLimits` checks, after parsing, the bounds a server is configured with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from spectral.args import ServerArgs
from spectral.sampling_params import (
    INT32_MAX,
    Count,
    Flag,
    InvalidRequestError,
    SamplingParams,
    SamplingParamsModel,
    Text,
    TokenId,
    short_repr,
    text,
)

# The hard ceiling of a request id; servers set a lower one (--max-rid-length).
MAX_RID_CHARS = 4096
Rid = text(min_length=1, max_length=MAX_RID_CHARS)
StartLen = Annotated[int, Field(strict=True, ge=-1, le=INT32_MAX)]


class RequestLimits:
    """How much one request may ask for: the request limits of ServerArgs, and their checks."""

    def __init__(self, args: ServerArgs | None = None) -> None:
        self.args = args or ServerArgs()

    @property
    def max_request_bytes(self) -> int:
        return self.args.max_request_bytes

    def check_sequences(self, count: int, what: str, param: str) -> None:
        if count > self.args.max_request_sequences:
            raise InvalidRequestError(
                f"{param}: the request starts {count} sequences ({what}); at most "
                f"{self.args.max_request_sequences} are allowed per request "
                "(--max-request-sequences)",
                param,
            )

    def check_rid(self, rid: str | None, param: str = "rid") -> None:
        if rid is not None and len(rid) > self.args.max_rid_length:
            raise InvalidRequestError(
                f"{param}: a request id may have at most {self.args.max_rid_length} characters "
                f"(got {short_repr(rid)})",
                param,
            )

    def check_top_logprobs(self, count: int, param: str) -> None:
        if count > self.args.max_top_logprobs_num:
            raise InvalidRequestError(
                f"{param}: at most {self.args.max_top_logprobs_num} top logprobs per token "
                f"(got {count})",
                param,
            )

    def check_sampling(self, params: SamplingParams, where: str = "sampling_params") -> None:
        """The stop strings and stop token ids are within their configured counts and sizes."""
        prefix = f"{where}." if where else ""
        for name in ("stop", "stop_token_ids"):
            count = len(getattr(params, name))
            if count > self.args.max_stop_strings:
                raise InvalidRequestError(
                    f"{prefix}{name}: at most {self.args.max_stop_strings} per request "
                    f"(got {count})",
                    prefix + name,
                )
        for i, stop in enumerate(params.stop):
            if len(stop) > self.args.max_stop_length:
                raise InvalidRequestError(
                    f"{prefix}stop.{i}: a stop string may have at most {self.args.max_stop_length} "
                    f"characters (got {short_repr(stop)})",
                    f"{prefix}stop",
                )


# SGLang's request fields that spectral does not act on, with the value that means "off": they
# are accepted at that value (or null, or a list of such values, one per prompt) and refused
# with a 400 naming them otherwise.
INERT_FIELDS: dict[str, Any] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "modalities": None,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "data_parallel_rank": None,
    "background": False,
    "priority": None,
    "extra_key": None,
    "return_bytes": False,
    "return_entropy": False,
}
# ... and the ones that only steer SGLang's own logging and metrics: any value is accepted.
LOGGING_FIELDS = ("log_metrics", "no_logs", "conversation_id", "custom_labels")


def _is_off(value: Any, off: Any) -> bool:
    if isinstance(value, list) and off is not None:
        return all(v is None or v == off for v in value)
    if isinstance(value, list):
        return all(v is None for v in value)
    return value is None or value == off


class GenerateRequest(BaseModel):
    """`POST /generate`: one prompt or a batch (`text` or `input_ids`, not both). SGLang's
    whole request schema is accepted: the fields spectral does not act on (LoRA, images,
    disaggregation, ...) only while they are off, and `model` and the logging fields
    whatever they say (SGLang's server ignores them too). Per-prompt lists of the logprob
    options are taken as SGLang takes them."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["text"], "properties": {"input_ids": {"type": "null"}}},
                {"required": ["input_ids"], "properties": {"text": {"type": "null"}}},
            ]
        },
    )

    text: Text | Annotated[list[Text], Field(min_length=1)] | None = None
    input_ids: (
        Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
        | None
    ) = None
    sampling_params: (
        SamplingParamsModel | Annotated[list[SamplingParamsModel], Field(min_length=1)] | None
    ) = None
    stream: Flag = False
    return_logprob: Flag | Annotated[list[Flag], Field(min_length=1)] | None = None
    top_logprobs_num: Count | Annotated[list[Count], Field(min_length=1)] | None = None
    logprob_start_len: StartLen | Annotated[list[StartLen], Field(min_length=1)] | None = None
    return_text_in_logprobs: Flag = False
    rid: Rid | Annotated[list[Rid], Field(min_length=1)] | None = None
    model: Any = Field(None, description="accepted and ignored, as SGLang does")
    log_metrics: Any = Field(None, description="accepted and ignored")
    no_logs: Any = Field(None, description="accepted and ignored")
    conversation_id: Any = Field(None, description="accepted and ignored")
    custom_labels: Any = Field(None, description="accepted and ignored")
    input_embeds: Any = Field(None, description="not supported: null only")
    image_data: Any = Field(None, description="not supported: null only")
    video_data: Any = Field(None, description="not supported: null only")
    audio_data: Any = Field(None, description="not supported: null only")
    token_ids_logprob: Any = Field(None, description="not supported: null only")
    return_hidden_states: Any = Field(None, description="not supported: null or false only")
    modalities: Any = Field(None, description="not supported: null only")
    session_params: Any = Field(None, description="not supported: null only")
    lora_path: Any = Field(None, description="not supported: null only")
    lora_id: Any = Field(None, description="not supported: null only")
    custom_logit_processor: Any = Field(None, description="not supported: null only")
    bootstrap_host: Any = Field(None, description="not supported: null only")
    bootstrap_port: Any = Field(None, description="not supported: null only")
    bootstrap_room: Any = Field(None, description="not supported: null only")
    bootstrap_pair_key: Any = Field(None, description="not supported: null only")
    data_parallel_rank: Any = Field(None, description="not supported: null only")
    background: Any = Field(None, description="not supported: null or false only")
    priority: Any = Field(None, description="not supported: null only")
    extra_key: Any = Field(None, description="not supported: null only")
    return_bytes: Any = Field(None, description="not supported: null or false only")
    return_entropy: Any = Field(None, description="not supported: null or false only")

    @field_validator(*INERT_FIELDS)
    @classmethod
    def _inert_is_off(cls, value: Any, info: ValidationInfo) -> Any:
        off = INERT_FIELDS[info.field_name]
        if not _is_off(value, off):
            allowed = "null" if off is None else f"null or {str(off).lower()}"
            raise ValueError(f"spectral does not support this field; send {allowed}")
        return value

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompt_count(self) -> int:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("give exactly one of text or input_ids", "text")
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)

    def jobs(self, limits: RequestLimits) -> list[Job]:
        """The sequences the request starts, prompt by prompt and each prompt's `n` samples in
        turn (SGLang's order), after checking that the lists line up with the prompts and every
        value is within `limits`."""
        n = self.prompt_count()
        field = "text" if self.text is not None else "input_ids"
        params = self._per_prompt("sampling_params", n)
        each = [(p or SamplingParamsModel()).to_params() for p in params]
        per_prompt = isinstance(self.sampling_params, list)
        for i, p in enumerate(each):
            limits.check_sampling(p, f"sampling_params.{i}" if per_prompt else "sampling_params")
        total = sum(p.n for p in each)
        limits.check_sequences(total, f"{n} prompts x n" if total > n else f"{n} prompts", field)
        rids = self._per_prompt("rid", n)
        if isinstance(self.rid, list) and len(set(self.rid)) != n:
            raise InvalidRequestError("rid: the ids of a batch must differ", "rid")
        for i, rid in enumerate(rids):
            limits.check_rid(rid, f"rid.{i}" if isinstance(self.rid, list) else "rid")
        wants = self._per_prompt("return_logprob", n)
        tops = self._per_prompt("top_logprobs_num", n)
        starts = self._per_prompt("logprob_start_len", n)
        for top in tops:
            limits.check_top_logprobs(top or 0, "top_logprobs_num")
        jobs = []
        for i, p in enumerate(each):
            for k in range(p.n):
                rid = rids[i] if p.n == 1 or rids[i] is None else f"{rids[i]}-{k}"
                start = -1 if starts[i] is None else starts[i]
                jobs.append(Job(i, p.for_sample(k), rid, bool(wants[i]), tops[i] or 0, start))
        return jobs

    @property
    def answers_a_list(self) -> bool:
        """A batch, or one prompt with n > 1: the answer is a list (streamed: chunks with an
        `index`)."""
        if self.is_batch:
            return True
        params = self.sampling_params
        return isinstance(params, SamplingParamsModel) and params.n > 1

    def _per_prompt(self, name: str, n: int) -> list[Any]:
        """Field `name` for each of the `n` prompts: one value for all, or a list with one per
        prompt."""
        value = getattr(self, name)
        if not isinstance(value, list):
            if name == "rid" and value is not None and self.is_batch:
                raise InvalidRequestError("rid: a batch needs a list of ids, one per prompt", "rid")
            return [value] * n
        if not self.is_batch or len(value) != n:
            raise InvalidRequestError(
                f"{name}: {len(value)} given for {n} prompt(s); give one value for all, or a "
                "list with one per prompt",
                name,
            )
        return value


@dataclass
class Job:
    """One sequence a /generate request starts."""

    prompt: int  # which prompt of the request
    params: SamplingParams
    rid: str | None
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: Rid


class MetaInfo(BaseModel):
    """What `meta_info` always holds; more keys come with logprobs and speculative decoding."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    context_length: int | None
    model_type: str | None
    architectures: list[str] | None
    # What of its architecture the model uses: q/k/v and MLP biases, tied embeddings, rope,
    # heads, sliding window (spectral's addition to SGLang's fields).
    features: dict[str, Any] | None
    # How the weights are served: gguf-int8, gguf or none (--quantization, auto resolved).
    quantization: str | None = None


class MessageResponse(BaseModel):
    message: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


# A streamed answer (`stream: true`): server-sent events, each `data: <JSON chunk>`, the last
# `data: [DONE]`.
SSE: dict[str, Any] = {
    "content": {
        "text/event-stream": {
            "itemSchema": {
                "type": "object",
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                "required": ["data"],
            }
        }
    }
}


# What every route that takes a request may answer besides its success.
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "the request is invalid (the message says how)"},
    413: {"model": ErrorResponse, "description": "the request body is too large"},
    500: {"model": ErrorResponse, "description": "serving the request failed"},
}


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
