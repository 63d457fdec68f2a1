"""The soak's traffic (bench/soak.py): one kind of request per function, each sent once and
classified by what came back. Every function takes the client and returns (outcome, latency,
time to first token); an outcome is "ok", "4xx:<status> <what>", "5xx:<status>", "lost" (sent
and never answered within the client's timeout, or the connection dropped), or "disconnect"
(the client hung up on purpose)."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx

Result = tuple[str, float | None, float | None]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
COLORS = 'root ::= color (", " color)*\ncolor ::= "red" | "green" | "blue"'
BODY_LIMIT = 2**20  # the soak's servers refuse bodies over 1 MiB (--max-request-bytes)


def _classify(res: httpx.Response) -> str:
    if res.status_code < 300:
        return "ok"
    if res.status_code < 500:
        try:
            what = res.json()["error"]["message"][:40]
        except (ValueError, KeyError, TypeError):
            what = res.text[:40]
        return f"4xx:{res.status_code} {' '.join(what.split(':')[0].split()[:3])}"
    return f"5xx:{res.status_code}"


async def _post(http: httpx.AsyncClient, path: str, body: dict) -> Result:
    start = time.perf_counter()
    try:
        res = await http.post(path, json=body)
    except (httpx.TransportError, httpx.TimeoutException):
        return "lost", None, None
    return _classify(res), time.perf_counter() - start, None


async def _stream(http: httpx.AsyncClient, path: str, body: dict, hang_up_after: int = 0) -> Result:
    """A streamed request read to its [DONE] (or, with `hang_up_after`, dropped after that
    many events)."""
    start = time.perf_counter()
    first = None
    events = 0
    try:
        async with http.stream("POST", path, json=body) as res:
            if res.status_code != 200:
                await res.aread()
                return _classify(res), time.perf_counter() - start, None
            async for line in res.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if first is None:
                    first = time.perf_counter() - start
                if line.strip() == "data: [DONE]":
                    return "ok", time.perf_counter() - start, first
                error = _stream_error(line)
                if error is not None:
                    return error, time.perf_counter() - start, first
                events += 1
                if hang_up_after and events >= hang_up_after:
                    return "disconnect", None, first
    except (httpx.TransportError, httpx.TimeoutException):
        return "lost", None, first
    return "lost", None, first  # the stream ended without [DONE]


def _stream_error(line: str) -> str | None:
    """An error event's outcome ("4xx:stream <status> <what>" or "5xx:..."), else None."""
    try:
        event = json.loads(line[len("data:") :])
    except ValueError:
        return None
    if not isinstance(event, dict) or "error" not in event:
        return None
    code = event["error"].get("code") or 500
    what = " ".join(str(event["error"].get("message", "")).split()[:6])
    return f"{'4xx' if code < 500 else '5xx'}:stream {code} {what}"


def _tokens() -> int:
    return random.randint(8, 48)


async def chat(http: httpx.AsyncClient) -> Result:
    messages = [
        {"role": "user", "content": f"Say something about the number {random.randint(1, 999)}."}
    ]
    return await _post(
        http,
        "/v1/chat/completions",
        {"model": "default", "messages": messages, "max_tokens": _tokens()},
    )


async def chat_stream(http: httpx.AsyncClient) -> Result:
    messages = [{"role": "user", "content": "Tell me a short story."}]
    body = {"model": "default", "messages": messages, "max_tokens": _tokens(), "stream": True}
    return await _stream(http, "/v1/chat/completions", body)


async def completions_n(http: httpx.AsyncClient) -> Result:
    body = {
        "model": "default",
        "prompt": "Once upon a time",
        "max_tokens": _tokens(),
        "n": 3,
        "temperature": 0.8,
    }
    return await _post(http, "/v1/completions", body)


async def native(http: httpx.AsyncClient) -> Result:
    params = {"max_new_tokens": _tokens(), "temperature": 0.7}
    return await _post(
        http, "/generate", {"text": "The capital of France is", "sampling_params": params}
    )


async def regex(http: httpx.AsyncClient) -> Result:
    params = {"max_new_tokens": 16, "regex": "(yes|no), [0-9]{2,4}"}
    return await _post(http, "/generate", {"text": "Answer:", "sampling_params": params})


async def schema(http: httpx.AsyncClient) -> Result:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    messages = [{"role": "user", "content": "A person, as JSON."}]
    body = {"model": "default", "messages": messages, "max_tokens": 48, "response_format": fmt}
    return await _post(http, "/v1/chat/completions", body)


async def ebnf(http: httpx.AsyncClient) -> Result:
    params = {"max_new_tokens": 16, "ebnf": COLORS}
    return await _post(http, "/generate", {"text": "Colors:", "sampling_params": params})


async def hostile_schema(http: httpx.AsyncClient) -> Result:
    """A deeply nested schema or a large enum, new each time (no cache helps)."""
    salt = uuid.uuid4().hex[:6]
    if random.random() < 0.5:
        inner: dict = {"type": "string", "pattern": f"{salt}[a-z]*"}
        for _ in range(40):
            inner = {"type": "object", "properties": {"x": inner}, "required": ["x"]}
    else:
        inner = {
            "type": "object",
            "properties": {"v": {"enum": [f"{salt}-{i}" for i in range(3000)]}},
        }
    params = {"max_new_tokens": 24, "json_schema": json.dumps(inner)}
    return await _post(http, "/generate", {"text": "JSON:", "sampling_params": params})


async def invalid(http: httpx.AsyncClient) -> Result:
    bad = random.choice(
        [
            {"text": "x", "sampling_params": {"temperature": -1}},
            {"text": "x", "sampling_params": {"max_new_tokens": "many"}},
            {"text": "x", "sampling_params": {"regex": "(unclosed"}},
            {"input_ids": [[1, 2], "three"]},
        ]
    )
    return await _post(http, "/generate", bad)


async def oversized(http: httpx.AsyncClient) -> Result:
    return await _post(http, "/generate", {"text": "a" * (2 * BODY_LIMIT)})


async def disconnect(http: httpx.AsyncClient) -> Result:
    params = {"max_new_tokens": 200, "ignore_eos": True}
    body = {"text": "Count slowly:", "sampling_params": params, "stream": True}
    return await _stream(http, "/generate", body, hang_up_after=random.randint(1, 5))


async def abort(http: httpx.AsyncClient) -> Result:
    """A long request aborted by its id while it runs: answered, with an abort reason."""
    rid = f"soak-{uuid.uuid4().hex}"
    params = {"max_new_tokens": 200, "ignore_eos": True}
    start = time.perf_counter()
    try:
        body = {"text": "Go on:", "sampling_params": params, "rid": rid}
        task = asyncio.ensure_future(http.post("/generate", json=body))
        await asyncio.sleep(0.3)
        await http.post("/abort_request", json={"rid": rid})
        res = await task
    except (httpx.TransportError, httpx.TimeoutException):
        return "lost", None, None
    return _classify(res), time.perf_counter() - start, None


# name -> (weight, function)
MIX: dict[str, tuple[float, Callable[[httpx.AsyncClient], Awaitable[Result]]]] = {
    "chat": (6, chat),
    "chat_stream": (6, chat_stream),
    "completions_n": (2, completions_n),
    "native": (4, native),
    "regex": (2, regex),
    "schema": (2, schema),
    "ebnf": (1, ebnf),
    "hostile_schema": (0.3, hostile_schema),
    "invalid": (1, invalid),
    "oversized": (0.3, oversized),
    "disconnect": (1, disconnect),
    "abort": (1, abort),
}


def pick() -> tuple[str, Callable[[httpx.AsyncClient], Awaitable[Result]]]:
    names = list(MIX)
    name = random.choices(names, weights=[MIX[n][0] for n in names])[0]
    return name, MIX[name][1]
