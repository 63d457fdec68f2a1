"""OpenAI's response shapes built from a request's states: the envelope every response and
stream chunk carries, the choices, and the logprobs in OpenAI's two formats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spectral.http.openai_protocol import CompletionRequest, finish_reason, new_id, now, usage
from spectral.http.tokenizer_manager import ReqState, TokenizerManager


@dataclass
class Envelope:
    """What every response and stream chunk of one request carries around its choices."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> Envelope:
        return cls(new_id(prefix), now(), model)

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def usage_chunk(self, obj: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk of a stream with `stream_options.include_usage`."""
        return self.wrap(obj, [], usage=usage(prompt_tokens, completion_tokens))

    def completion_chunk(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        return self.wrap("text_completion", [choice])

    def chat_chunk(self, index: int, delta: dict[str, str], reason: str | None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self.wrap("chat.completion.chunk", [choice])


def completion_choice(
    manager: TokenizerManager, body: CompletionRequest, index: int, ids: list[int], state: ReqState
) -> dict[str, Any]:
    """A finished /v1/completions choice; with `echo`, the prompt leads its text (and with
    logprobs its scores: the first prompt token has none, as OpenAI gives it)."""
    text, logprobs = state.text, None
    if body.logprobs is not None:
        scored = state.logprobs
        if body.echo:
            prompt = state.meta.get("input_token_logprobs") or []
            scored = [(lp, tok, None) for lp, tok in prompt] + scored
        logprobs = completion_logprobs(manager, scored)
    if body.echo:
        text = manager.tokenizer.decode(ids) + text
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(state.finish_reason),
    }


def chat_choice(
    manager: TokenizerManager, index: int, state: ReqState, logprobs: bool
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": state.text},
        "logprobs": chat_logprobs(manager, state) if logprobs else None,
        "finish_reason": finish_reason(state.finish_reason),
    }


def completion_logprobs(manager: TokenizerManager, scored: list[Any]) -> dict[str, Any]:
    """OpenAI's completion logprobs for (logprob, token, top logprobs or None) entries."""
    tokens, token_logprobs, tops, offsets, offset = [], [], [], [], 0
    for lp, tok, top in scored:
        text = manager.token_text(tok)
        tokens.append(text)
        token_logprobs.append(lp)
        tops.append({manager.token_text(t): v for v, t in (top or [])} or None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(manager: TokenizerManager, state: ReqState) -> dict[str, Any]:
    """OpenAI's chat logprobs: each token's text, logprob and bytes, with its top tokens."""
    content = []
    for lp, tok, top in state.logprobs:
        text = manager.token_text(tok)
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": manager.token_text(t),
                        "logprob": v,
                        "bytes": list(manager.token_text(t).encode()),
                    }
                    for v, t in (top or [])
                ],
            }
        )
    return {"content": content}
