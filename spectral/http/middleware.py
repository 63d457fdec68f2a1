"""The app's plain ASGI middleware (unlike BaseHTTPMiddleware it leaves disconnect detection
intact): the API key, JSON bodies whatever their Content-Type, and the body size limit."""

from __future__ import annotations

from typing import Any

import orjson

from spectral.http.protocol import error_body


class ApiKeyMiddleware:
    """Every path but /health needs `Authorization: Bearer <api_key>`."""

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
