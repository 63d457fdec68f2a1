"""The OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from spectral.sampling_params import SamplingParams
from spectral.server.http_common import (
    ORJSONResponse,
    event_stream,
    run_all,
    sse,
    unless_disconnected,
)
from spectral.server.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    finish_reason,
    new_id,
    now,
    usage,
)
from spectral.server.protocol import SSE, ErrorResponse, RequestLimits
from spectral.server.tokenizer_manager import ReqState, TokenizerManager

# What the OpenAI routes may answer besides their success (SSE when streaming).
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: SSE,
    400: {"model": ErrorResponse, "description": "the request is invalid (the message says how)"},
    413: {"model": ErrorResponse, "description": "the request body is too large"},
    500: {"model": ErrorResponse, "description": "serving the request failed"},
}


def add_openai_routes(
    app: FastAPI, manager: TokenizerManager, served_model: str, limits: RequestLimits
) -> None:
    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        card = {"id": served_model, "object": "model", "created": now(), "owned_by": "spectral"}
        return {"object": "list", "data": [card]}

    def prepared(
        prompts: list[list[int]], params: SamplingParams, n: int, top: int, top_param: str
    ) -> list[tuple[int, list[int], SamplingParams]]:
        """(choice index, prompt, parameters) of every sequence, each checked before any
        runs."""
        limits.check_sequences(len(prompts) * n, f"{len(prompts)} prompts x n={n}", "n")
        limits.check_sampling(params, "")
        limits.check_top_logprobs(top, top_param)
        jobs = [
            (i * n + k, ids, params.for_sample(k))
            for i, ids in enumerate(prompts)
            for k in range(n)
        ]
        for _, ids, p in jobs:
            manager.check(ids, p, None)
        return jobs

    @app.post("/v1/completions", response_model=CompletionResponse, responses=RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        params = SamplingParams.from_dict(body.sampling_dict(body.max_tokens))
        prompts = await _completion_prompts(manager, body.prompt)
        top = body.logprobs or 0
        want_logprobs = body.logprobs is not None
        jobs = prepared(prompts, params, body.n, top, "logprobs")
        group = manager.new_rid()
        cid, created = new_id("cmpl"), now()
        model = body.model or served_model

        # echo with logprobs scores the prompt too (its first token has none), as OpenAI does.
        prompt_start = 0 if body.echo and want_logprobs else -1

        def choice(index: int, ids: list[int], state: ReqState, text: str) -> dict[str, Any]:
            logprobs = None
            if want_logprobs:
                scored = state.logprobs
                if body.echo:
                    prompt = state.meta.get("input_token_logprobs") or []
                    scored = [(lp, tok, None) for lp, tok in prompt] + scored
                logprobs = _completion_logprobs(manager, scored)
            if body.echo:
                text = manager.tokenizer.decode(ids) + text
            return {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(state.finish_reason),
            }

        if body.stream:

            async def events() -> AsyncIterator[bytes]:
                total_prompt = total_completion = 0
                for index, ids, p in jobs:
                    sent = 0
                    if body.echo:
                        yield sse(
                            _completion_chunk(
                                cid, created, model, index, manager.tokenizer.decode(ids), None
                            )
                        )
                    async for state in manager.generate(
                        ids, p, None, want_logprobs, top, group=group
                    ):
                        delta, sent = state.text[sent:], len(state.text)
                        yield sse(
                            _completion_chunk(
                                cid,
                                created,
                                model,
                                index,
                                delta,
                                finish_reason(state.finish_reason),
                            )
                        )
                    total_prompt += len(ids)
                    total_completion += len(state.output_ids)
                if body.stream_options and body.stream_options.include_usage:
                    yield sse(
                        _usage_chunk(
                            cid, "text_completion", created, model, total_prompt, total_completion
                        )
                    )

            return event_stream(events())
        gens = [
            manager.generate(ids, p, None, want_logprobs, top, prompt_start, group)
            for _, ids, p in jobs
        ]
        states = await unless_disconnected(request, run_all(gens))
        if isinstance(states, Response):
            return states
        choices = [choice(index, ids, s, s.text) for (index, ids, _), s in zip(jobs, states)]
        prompt_tokens = sum(len(ids) for _, ids, _ in jobs)
        completion_tokens = sum(len(s.output_ids) for s in states)
        return ORJSONResponse(
            _envelope(
                cid,
                "text_completion",
                created,
                model,
                choices,
                usage=usage(prompt_tokens, completion_tokens),
            )
        )

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        params = SamplingParams.from_dict(body.sampling_dict(max_tokens))
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()}
            for m in body.messages
        ]
        ids = await manager.apply_chat_template(messages, body.chat_template_kwargs or {})
        top = body.top_logprobs or 0
        jobs = prepared([ids], params, body.n, top, "top_logprobs")
        group = manager.new_rid()
        cid, created = new_id("chatcmpl"), now()
        model = body.model or served_model
        if body.stream:

            async def events() -> AsyncIterator[bytes]:
                completion = 0
                for k, _, p in jobs:
                    sent = 0
                    first = {"role": "assistant", "content": ""}
                    yield sse(_chat_chunk(cid, created, model, k, first, None))
                    async for state in manager.generate(
                        ids, p, None, body.logprobs, top, group=group
                    ):
                        delta, sent = state.text[sent:], len(state.text)
                        yield sse(
                            _chat_chunk(
                                cid,
                                created,
                                model,
                                k,
                                {"content": delta},
                                finish_reason(state.finish_reason),
                            )
                        )
                    completion += len(state.output_ids)
                if body.stream_options and body.stream_options.include_usage:
                    yield sse(
                        _usage_chunk(
                            cid,
                            "chat.completion.chunk",
                            created,
                            model,
                            len(ids) * body.n,
                            completion,
                        )
                    )

            return event_stream(events())
        gens = [manager.generate(ids, p, None, body.logprobs, top, group=group) for _, _, p in jobs]
        states = await unless_disconnected(request, run_all(gens))
        if isinstance(states, Response):
            return states
        choices = [
            {
                "index": k,
                "message": {"role": "assistant", "content": s.text},
                "logprobs": _chat_logprobs(manager, s) if body.logprobs else None,
                "finish_reason": finish_reason(s.finish_reason),
            }
            for k, s in enumerate(states)
        ]
        completion_tokens = sum(len(s.output_ids) for s in states)
        return ORJSONResponse(
            _envelope(
                cid,
                "chat.completion",
                created,
                model,
                choices,
                usage=usage(len(ids) * body.n, completion_tokens),
            )
        )


async def _completion_prompts(manager: TokenizerManager, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        return await manager.tokenize(prompt, "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _envelope(cid, obj, created, model, choices, **extra) -> dict[str, Any]:
    """What every completion response and stream chunk carries around its choices."""
    return {
        "id": cid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }


def _usage_chunk(cid, obj, created, model, prompt_tokens, completion_tokens) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`."""
    return _envelope(cid, obj, created, model, [], usage=usage(prompt_tokens, completion_tokens))


def _completion_chunk(cid, created, model, index, text, reason) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    return _envelope(cid, "text_completion", created, model, [choice])


def _chat_chunk(cid, created, model, index, delta, reason) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
    return _envelope(cid, "chat.completion.chunk", created, model, [choice])


def _completion_logprobs(manager: TokenizerManager, scored: list[Any]) -> dict[str, Any]:
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


def _chat_logprobs(manager: TokenizerManager, state: ReqState) -> dict[str, Any]:
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
