"""The HTTP app: SGLang's native endpoints and the OpenAI-compatible API.

Every handler turns bad input into a 4xx with an OpenAI-shaped error body; a client that
disconnects mid-stream has its request aborted (the generator's cleanup sends the abort).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from spectral.sampling_params import InvalidRequestError, SamplingParams
from spectral.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    finish_reason,
    new_id,
    now,
    usage,
)
from spectral.server.tokenizer_manager import ReqState, TokenizerManager


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: str | list[str] | None = None


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ApiKeyMiddleware:
    """Plain ASGI middleware (unlike BaseHTTPMiddleware it leaves disconnect detection intact):
    every path but /health needs `Authorization: Bearer <api_key>`."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != self.expected:
                body = orjson.dumps(
                    error_body("missing or wrong API key: send 'Authorization: Bearer <key>'", 401)
                )
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class JsonBodyMiddleware:
    """Every POST body is JSON, whatever its Content-Type says: `curl -d` sends
    application/x-www-form-urlencoded, and a body without the header would otherwise fail
    validation with a message about dictionaries."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


def create_app(
    manager: TokenizerManager, served_model: str, info: dict[str, Any], api_key: str | None
) -> FastAPI:
    app = FastAPI(default_response_class=ORJSONResponse)

    def error(message: str, status: int = 400) -> ORJSONResponse:
        return ORJSONResponse(error_body(message, status), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> ORJSONResponse:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {e.get('msg')}")
        return error("invalid request: " + "; ".join(problems))

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> ORJSONResponse:
        return error(str(exc))

    app.add_middleware(JsonBodyMiddleware)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    # ---- native API ----------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        params = SamplingParams(max_new_tokens=1)
        async for _ in manager.generate(manager.tokenize("ping"), params):
            pass
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": served_model,
            "is_generation": True,
            "context_length": info.get("context_length"),
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {**info, **(await manager.control("server_info"))}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = manager.metrics.render(await manager.control("server_info"))
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> ORJSONResponse:
        result = await manager.control("flush_cache")
        if result.get("success"):
            return ORJSONResponse({"message": "Cache flushed."})
        return error("cannot flush the cache while requests are running or waiting")

    @app.post("/abort_request")
    async def abort_request(body: dict[str, Any]) -> dict[str, Any]:
        await manager.abort(str(body.get("rid", "")))
        return {}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        prompts = _native_prompts(manager, body)
        params = body.sampling_params
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise InvalidRequestError(
                f"{len(param_list)} sampling_params for {len(prompts)} prompts"
            )
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        gens = [
            manager.generate(
                ids,
                SamplingParams.from_dict(p),
                rid,
                body.return_logprob,
                body.top_logprobs_num,
                body.logprob_start_len,
            )
            for ids, p, rid in zip(prompts, param_list, rids)
        ]
        single = (
            body.text is not None
            and isinstance(body.text, str)
            or (
                body.input_ids is not None and body.input_ids and isinstance(body.input_ids[0], int)
            )
        )
        if body.stream:
            if len(gens) != 1:
                raise InvalidRequestError("stream takes one prompt")

            async def events() -> AsyncIterator[bytes]:
                async for state in gens[0]:
                    yield sse(state.output())
                yield sse(b"[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")
        outs = await _unless_disconnected(request, asyncio.gather(*(_final(g) for g in gens)))
        if isinstance(outs, Response):
            return outs
        return outs[0].output() if single else [o.output() for o in outs]

    # ---- OpenAI API ----------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_model, "object": "model", "created": now(), "owned_by": "spectral"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = _completion_prompts(manager, body.prompt)
        params = SamplingParams.from_dict(body.sampling_dict(body.max_tokens))
        top = body.logprobs or 0
        want_logprobs = body.logprobs is not None
        jobs = [
            (i * body.n + k, ids, _seeded(params, k))
            for i, ids in enumerate(prompts)
            for k in range(body.n)
        ]
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
                    scored = [(lp, tok, None) for lp, tok, _ in prompt] + scored
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
                    async for state in manager.generate(ids, p, None, want_logprobs, top):
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
                yield sse(b"[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")
        states = await _unless_disconnected(
            request,
            asyncio.gather(
                *(
                    _final(manager.generate(ids, p, None, want_logprobs, top, prompt_start))
                    for _, ids, p in jobs
                )
            ),
        )
        if isinstance(states, Response):
            return states
        choices = [choice(index, ids, s, s.text) for (index, ids, _), s in zip(jobs, states)]
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(
                sum(len(ids) for _, ids, _ in jobs), sum(len(s.output_ids) for s in states)
            ),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()}
            for m in body.messages
        ]
        ids = manager.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        params = SamplingParams.from_dict(body.sampling_dict(max_tokens))
        top = body.top_logprobs or 0
        cid, created = new_id("chatcmpl"), now()
        model = body.model or served_model
        if body.stream:

            async def events() -> AsyncIterator[bytes]:
                completion = 0
                for k in range(body.n):
                    sent = 0
                    first = {"role": "assistant", "content": ""}
                    yield sse(_chat_chunk(cid, created, model, k, first, None))
                    async for state in manager.generate(
                        list(ids), _seeded(params, k), None, body.logprobs, top
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
                yield sse(b"[DONE]")

            return StreamingResponse(events(), media_type="text/event-stream")
        states = await _unless_disconnected(
            request,
            asyncio.gather(
                *(
                    _final(
                        manager.generate(list(ids), _seeded(params, k), None, body.logprobs, top)
                    )
                    for k in range(body.n)
                )
            ),
        )
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
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(len(ids) * body.n, sum(len(s.output_ids) for s in states)),
        }

    return app


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)


async def _final(gen: AsyncIterator[ReqState]) -> ReqState:
    state = None
    async for latest in gen:
        state = latest
    assert state is not None
    return state


def _seeded(params: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n choices: a different seed when one was given, so choices differ."""
    if k == 0 or params.seed is None:
        return params
    from spectral.server.tokenizer_manager import copy_params

    return copy_params(params, seed=params.seed + k)


def _native_prompts(manager: TokenizerManager, body: GenerateRequest) -> list[list[int]]:
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError("give exactly one of text or input_ids")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        return [manager.tokenize(t) if t else [] for t in texts]
    ids = body.input_ids
    return [list(ids)] if not ids or isinstance(ids[0], int) else [list(x) for x in ids]


def _completion_prompts(manager: TokenizerManager, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [manager.tokenize(prompt) if prompt else []]
    if not prompt:
        raise InvalidRequestError("prompt is empty")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [manager.tokenize(p) if p else [] for p in prompt]
    return [list(p) for p in prompt]


def _usage_chunk(cid, obj, created, model, prompt_tokens, completion_tokens) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`."""
    return {
        "id": cid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def _completion_chunk(cid, created, model, index, text, reason) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}],
    }


def _chat_chunk(cid, created, model, index, delta, reason) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}],
    }


def _token_text(manager: TokenizerManager, token: int) -> str:
    return manager.tokenizer.decode([token])


def _completion_logprobs(manager: TokenizerManager, scored: list[Any]) -> dict[str, Any]:
    """OpenAI's completion logprobs for (logprob, token, top logprobs or None) entries."""
    tokens, token_logprobs, tops, offsets, offset = [], [], [], [], 0
    for lp, tok, top in scored:
        text = _token_text(manager, tok)
        tokens.append(text)
        token_logprobs.append(lp)
        tops.append({_token_text(manager, t): v for v, t in (top or [])} or None)
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
        text = _token_text(manager, tok)
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": _token_text(manager, t),
                        "logprob": v,
                        "bytes": list(_token_text(manager, t).encode()),
                    }
                    for v, t in (top or [])
                ],
            }
        )
    return {"content": content}
