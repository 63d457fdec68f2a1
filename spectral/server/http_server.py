"""The HTTP app: SGLang's native endpoints (the OpenAI-compatible ones are in openai_api.py).

Every handler turns bad input into a 4xx with an OpenAI-shaped error body; a client that
disconnects mid-stream has its request aborted (the generator's cleanup sends the abort).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from spectral.sampling_params import InvalidRequestError, SamplingParams, validation_error
from spectral.server.http_common import (
    OrjsonBodyRoute,
    ORJSONResponse,
    error_response,
    event_stream,
    merged,
    run_all,
    sse,
    unless_disconnected,
)
from spectral.server.openai_api import add_openai_routes
from spectral.server.protocol import (
    SSE,
    AbortRequest,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    MessageResponse,
    ModelInfo,
    RequestLimits,
    error_body,
)
from spectral.server.tokenizer_manager import RequestFailedError, TokenizerManager


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
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                await send_json(send, 401, error_body(message, 401))
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


class BodyLimitMiddleware:
    """Refuse a body over `limit` bytes with a 413 before reading it (a larger Content-Length)
    or as soon as it grows past the limit (a chunked upload), reading the rest into nothing
    so the client gets the answer; a body within the limit is read once and handed on."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(receive, send, int(declared), more=True)
            return
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.limit:
                await self._refuse(receive, send, size, more)
                return
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # from here on: disconnect notices
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Any, send: Any, size: int, more: bool) -> None:
        message = (
            f"the request body has {'at least ' if more else ''}{size} bytes; at most "
            f"{self.limit} are accepted (--max-request-bytes)"
        )
        await send_json(send, 413, error_body(message, 413))
        while more:
            msg = await receive()
            more = msg["type"] == "http.request" and msg.get("more_body", False)


async def send_json(send: Any, status: int, body: dict) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": orjson.dumps(body)})


def create_app(
    manager: TokenizerManager,
    served_model: str,
    info: dict[str, Any],
    api_key: str | None,
    limits: RequestLimits | None = None,
) -> FastAPI:
    limits = limits or RequestLimits()
    app = FastAPI(default_response_class=ORJSONResponse, title="spectral")
    app.router.route_class = OrjsonBodyRoute

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> ORJSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> ORJSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestFailedError)
    async def failed_request(_: Request, exc: RequestFailedError) -> ORJSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> ORJSONResponse:
        return ORJSONResponse(
            error_body(str(exc.detail), exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    # ---- native API ----------------------------------------------------------------------------

    @app.get("/health", response_class=Response, responses={200: {"description": "serving"}})
    async def health() -> Response:
        return Response(status_code=200)

    @app.get(
        "/health_generate",
        response_class=Response,
        responses={200: {"description": "a one-token generation ran"}, **ERRORS},
    )
    async def health_generate() -> Response:
        params = SamplingParams(max_new_tokens=1)
        [ids] = await manager.tokenize("ping")
        async for _ in manager.generate(ids, params):
            pass
        return Response(status_code=200)

    # SGLang serves these under both names (sglang-router and newer SGLang clients ask for
    # /server_info and /model_info first).
    @app.get("/get_model_info", response_model=ModelInfo, responses=ERRORS)
    @app.get("/model_info", response_model=ModelInfo, responses=ERRORS)
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": served_model,
            "tokenizer_path": info.get("tokenizer_path"),
            "is_generation": True,
            "context_length": info.get("context_length"),
            "model_type": info.get("model_type"),
            "architectures": info.get("architectures"),
            "features": info.get("features"),
        }

    @app.get("/get_server_info", response_model=dict[str, Any], responses=ERRORS)
    @app.get("/server_info", response_model=dict[str, Any], responses=ERRORS)
    async def server_info() -> dict[str, Any]:
        state = await manager.control("server_info")
        # SGLang's per-rank state; bench_serving reports the accept length from it.
        internal = {"avg_spec_accept_length": state["stats"].get("spec_accept_length") or None}
        return {**info, **state, "internal_states": [internal]}

    @app.get("/get_load", response_model=list[dict[str, int]], responses=ERRORS)
    async def get_load() -> list[dict[str, int]]:
        """SGLang's load report (sglang-router's power-of-two policy reads num_tokens)."""
        state = await manager.control("server_info")
        memory = state["memory"]
        held = memory["total_tokens"] - memory["free_tokens"] - memory["evictable_tokens"]
        return [
            {
                "dp_rank": 0,
                "num_reqs": state["requests"]["running"],
                "num_waiting_reqs": state["requests"]["waiting"],
                "num_tokens": held,
            }
        ]

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        body = manager.metrics.render(await manager.control("server_info"))
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.api_route(
        "/flush_cache", methods=["GET", "POST"], response_model=MessageResponse, responses=ERRORS
    )
    async def flush_cache() -> ORJSONResponse:
        result = await manager.control("flush_cache")
        if result.get("success"):
            return ORJSONResponse({"message": "Cache flushed."})
        raise InvalidRequestError("cannot flush the cache while requests are running or waiting")

    @app.post("/abort_request", response_model=dict[str, Any], responses=ERRORS)
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        await manager.abort(body.rid)
        return {}

    @app.post(
        "/generate",
        response_model=GenerateResponse | list[GenerateResponse],
        responses={
            200: SSE,
            **ERRORS,
        },
    )
    async def generate(body: GenerateRequest, request: Request):
        jobs = body.jobs(limits)
        if body.text is not None:
            prompts = await manager.tokenize(body.text)
        else:
            prompts = [body.input_ids] if not body.is_batch else body.input_ids
        for job in jobs:
            ids = prompts[job.prompt]
            start = job.logprob_start_len if job.return_logprob else -1
            try:
                manager.check(ids, job.params, job.rid, start)
            except InvalidRequestError as err:
                raise batch_error(err, job.prompt, body.is_batch) from None
        group = manager.new_rid() if len(jobs) > 1 else None
        gens = [
            manager.generate(
                prompts[job.prompt],
                job.params,
                job.rid,
                job.return_logprob,
                job.top_logprobs_num,
                job.logprob_start_len,
                group,
            )
            for job in jobs
        ]
        token_text = manager.token_text if body.return_text_in_logprobs else None
        if body.stream:

            async def events() -> AsyncIterator[bytes]:
                if not body.answers_a_list:
                    async for state in gens[0]:
                        yield sse(state.output(token_text))
                    return
                async for index, out in merged(gens, lambda s: s.output(token_text)):
                    yield sse({**out, "index": index})

            return event_stream(events())
        outs = await unless_disconnected(request, run_all(gens))
        if isinstance(outs, Response):
            return outs
        outputs = [o.output(token_text) for o in outs]
        return ORJSONResponse(outputs if body.answers_a_list else outputs[0])

    add_openai_routes(app, manager, served_model, limits)
    app.openapi = lambda: openapi_document(app, bool(api_key))
    return app


# What every route that takes a request may answer besides its success.
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "the request is invalid (the message says how)"},
    413: {"model": ErrorResponse, "description": "the request body is too large"},
    500: {"model": ErrorResponse, "description": "serving the request failed"},
}


def batch_error(err: InvalidRequestError, index: int, is_batch: bool) -> InvalidRequestError:
    """`err` about the index-th prompt of a batch says which one it is about."""
    if not is_batch:
        return err
    return InvalidRequestError(f"prompt {index}: {err}", err.param)


def openapi_document(app: FastAPI, api_key: bool) -> dict[str, Any]:
    """FastAPI's document, less the 422 answers it adds (validation errors are 400s here), and
    with the 401 that every route but /health may answer when an API key is set."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error = {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
        unauthorized = {
            "description": "missing or wrong API key",
            "content": {"application/json": error},
        }
        for route, path in doc.get("paths", {}).items():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
                if api_key and route != "/health":
                    operation["responses"]["401"] = unauthorized
        schemas = doc.get("components", {}).get("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        app.openapi_schema = doc
    return app.openapi_schema
