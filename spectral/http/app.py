"""The FastAPI app: the native and OpenAI-compatible routes, the middleware, and the error
handlers that turn bad input into a 4xx with an OpenAI-shaped error body."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException

from spectral.http import native_api, openai_api
from spectral.http.common import ORJSONResponse, error_response
from spectral.http.middleware import ApiKeyMiddleware, BodyLimitMiddleware, JsonBodyMiddleware
from spectral.http.protocol import RequestLimits, error_body
from spectral.http.state import Serving
from spectral.http.tokenizer_manager import RequestFailedError, TokenizerManager
from spectral.sampling_params import InvalidRequestError, validation_error


def create_app(
    manager: TokenizerManager,
    served_model: str,
    info: dict[str, Any],
    api_key: str | None,
    limits: RequestLimits | None = None,
) -> FastAPI:
    limits = limits or RequestLimits()
    app = FastAPI(default_response_class=ORJSONResponse, title="spectral")
    app.state.serving = Serving(manager, served_model, info, limits)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(InvalidRequestError, request_error)
    app.add_exception_handler(RequestFailedError, request_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    app.openapi = functools.partial(openapi_document, app, bool(api_key))
    return app


async def invalid_body(_: Request, exc: RequestValidationError) -> ORJSONResponse:
    return error_response(validation_error(list(exc.errors())))


async def request_error(_: Request, exc: Exception) -> ORJSONResponse:
    """A request that can never run (400) or that failed while served (500)."""
    return error_response(exc)


async def http_error(_: Request, exc: StarletteHTTPException) -> ORJSONResponse:
    return ORJSONResponse(
        error_body(str(exc.detail), exc.status_code),
        status_code=exc.status_code,
        headers=exc.headers,
    )


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
