"""What the native and the OpenAI routes share: the JSON response class, SSE framing, and
waiting on requests while watching for the client to go away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from spectral.server.tokenizer_manager import ReqState


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


async def unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)


async def final_state(gen: AsyncIterator[ReqState]) -> ReqState:
    state = None
    async for latest in gen:
        state = latest
    assert state is not None
    return state
