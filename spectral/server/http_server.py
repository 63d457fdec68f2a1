"""The HTTP app: SGLang's native endpoints (the OpenAI-compatible ones are in openai_api.py).

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
from spectral.server.http_common import ORJSONResponse, final_state, sse, unless_disconnected
from spectral.server.openai_api import add_openai_routes
from spectral.server.openai_protocol import error_body
from spectral.server.tokenizer_manager import TokenizerManager


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
        outs = await unless_disconnected(request, asyncio.gather(*(final_state(g) for g in gens)))
        if isinstance(outs, Response):
            return outs
        return outs[0].output() if single else [o.output() for o in outs]

    add_openai_routes(app, manager, served_model)
    return app


def _native_prompts(manager: TokenizerManager, body: GenerateRequest) -> list[list[int]]:
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError("give exactly one of text or input_ids")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        return [manager.tokenize(t) if t else [] for t in texts]
    ids = body.input_ids
    return [list(ids)] if not ids or isinstance(ids[0], int) else [list(x) for x in ids]
