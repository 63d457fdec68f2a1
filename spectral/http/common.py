"""What the native and the OpenAI routes share: the JSON response class, SSE framing (errors
included), running a request's sequences together, and watching for the client to go away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from spectral.http.protocol import error_body
from spectral.http.tokenizer_manager import ReqState, RequestFailedError
from spectral.sampling_params import InvalidRequestError


class ORJSONResponse(JSONResponse):
    """JSON by orjson (a JSONResponse, so FastAPI documents the route's response model)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class OrjsonBodyRoute(APIRoute):
    """A route whose JSON body is parsed by orjson (faster than the standard library on long
    lists of ids, and the parse holds the event loop). A body orjson refuses
    (big integers, NaN, lone surrogates) is left to FastAPI's own parser, whose result the
    models then refuse naming the field."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            body = await request.body()
            if body:
                try:
                    request._json = orjson.loads(body)
                except orjson.JSONDecodeError:
                    pass
            return await handler(request)

        return route


def sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


def error_response(err: Exception) -> ORJSONResponse:
    """The OpenAI-shaped error response for an exception a request raised."""
    status, param = status_of(err), getattr(err, "param", None)
    return ORJSONResponse(error_body(str(err), status, param), status_code=status)


def status_of(err: Exception) -> int:
    return 400 if isinstance(err, InvalidRequestError) else getattr(err, "status", 500)


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    """An SSE response of `events`, ending with `data: [DONE]`. A request that fails after
    the headers are sent ends its stream with an error event (OpenAI's error body) first."""

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except (InvalidRequestError, RequestFailedError) as err:
            yield sse(error_body(str(err), status_of(err), getattr(err, "param", None)))
        yield sse(b"[DONE]")

    return StreamingResponse(guarded(), media_type="text/event-stream")


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
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


async def run_all(gens: list[AsyncIterator[ReqState]]) -> list[ReqState]:
    """The final states of a request's sequences, run together. If one fails, the others are
    cancelled (which aborts them and frees their KV) and its error is raised; so they are if
    the caller is cancelled (a client that went away)."""
    tasks = [asyncio.ensure_future(final_state(g)) for g in gens]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(
    gens: list[AsyncIterator[ReqState]], render: Callable[[ReqState], Any]
) -> AsyncIterator[tuple[int, Any]]:
    """(index, render(state)) of a request's sequences as each advances, all run together
    (a streamed batch). If one fails, the others are cancelled and its error is raised; so
    they are when the caller stops iterating."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, gen: AsyncIterator[ReqState]) -> None:
        try:
            async for state in gen:
                queue.put_nowait((index, render(state)))
            queue.put_nowait((index, done))
        except Exception as err:
            queue.put_nowait((index, err))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
