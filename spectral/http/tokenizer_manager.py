"""TokenizerManager: the HTTP process's side of the pipeline. It tokenizes, sends requests to
the scheduler, and hands each request's outputs (from the detokenizer) to whoever awaits them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from spectral.core.req import TokenizedRequest, check_request
from spectral.http.metrics import Metrics
from spectral.logprobs import logprob_meta
from spectral.sampling_params import InvalidRequestError, SamplingParams
from spectral.server.ipc import arecv_message, asend_message
from spectral.server.messages import (
    AbortReq,
    BatchStrOut,
    ControlOut,
    ControlReq,
    RequestRejected,
)

# Threads that tokenize (off the event loop, so that a long prompt stalls no other request).
TOKENIZER_THREADS = 2


class RequestFailedError(Exception):
    """A request that failed while it was served (a process raised on it): status 500."""

    status = 500


@dataclass
class ReqState:
    """What one request has produced so far (cumulative)."""

    rid: str
    prompt_tokens: int
    return_logprob: bool = False
    top_logprobs_num: int = 0
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.perf_counter)
    last_update: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, token_text: Callable[[int], str] | None = None) -> dict[str, Any]:
        """SGLang's output object: text, ids and meta_info (logprob entries with their token
        text when `token_text` is given)."""
        meta = {"id": self.rid, **self.meta, "finish_reason": self.finish_reason}
        if self.return_logprob:
            meta |= logprob_meta(
                meta.get("input_token_logprobs", []),
                [(lp, tok) for lp, tok, _ in self.logprobs],
                [top for _, _, top in self.logprobs] if self.top_logprobs_num else None,
                token_text,
            )
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class TokenizerManager:
    def __init__(
        self,
        tokenizer: Any,
        ipc_dir: str,
        context_len: int,
        vocab_size: int,
        num_kv_slots: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.num_kv_slots = num_kv_slots
        # No token stands for more characters than its vocabulary entry has, so a text longer
        # than this has more tokens than the context holds, whatever it says.
        self.max_prompt_chars = context_len * max(len(t) for t in tokenizer.get_vocab())
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.connect(f"ipc://{ipc_dir}/scheduler_in")
        self.from_detokenizer = self.ctx.socket(zmq.PULL)
        self.from_detokenizer.bind(f"ipc://{ipc_dir}/tokenizer_in")
        self.states: dict[str, ReqState] = {}
        self._token_texts: dict[int, str] = {}
        self.metrics = Metrics()
        self.calls: dict[str, asyncio.Future] = {}
        self._counter = itertools.count()
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._dispatch_loop())

    async def _dispatch_loop(self) -> None:
        while True:
            msg = await arecv_message(self.from_detokenizer)
            if isinstance(msg, BatchStrOut):
                for i, rid in enumerate(msg.rids):
                    state = self.states.get(rid)
                    if state is None:
                        continue
                    state.text += msg.text_deltas[i]
                    state.output_ids.extend(msg.new_ids[i])
                    state.logprobs.extend(msg.new_logprobs[i])
                    state.meta.update(msg.meta[i])
                    t = time.perf_counter()
                    if msg.new_ids[i]:
                        first = state.first_token_at is None
                        self.metrics.observe_tokens(
                            len(msg.new_ids[i]), t - state.last_update, first
                        )
                        state.first_token_at = state.first_token_at or t
                        state.last_update = t
                    reason = msg.finished_reasons[i]
                    if reason is not None and reason["type"] == "abort" and "message" in reason:
                        state.updates.put_nowait(RequestFailedError(reason["message"]))
                        continue
                    if reason is not None:
                        state.finish_reason = reason
                        self.metrics.observe_finished(
                            state.prompt_tokens, len(state.output_ids), t - state.created
                        )
                    state.updates.put_nowait(None)
            elif isinstance(msg, RequestRejected):
                state = self.states.get(msg.rid)
                if state is not None:
                    error = (
                        InvalidRequestError(msg.error)
                        if msg.status == 400
                        else RequestFailedError(msg.error)
                    )
                    state.updates.put_nowait(error)
            elif isinstance(msg, ControlOut):
                future = self.calls.pop(msg.call_id, None)
                if future is not None and not future.done():
                    future.set_result(msg.result)

    async def tokenize(self, text: str | list[str], param: str = "text") -> list[list[int]]:
        """Token ids of each text, computed in a thread; a text too long for the context
        whatever its tokens is refused before any work."""
        texts = [text] if isinstance(text, str) else text
        for i, t in enumerate(texts):
            if len(t) > self.max_prompt_chars:
                where = param if isinstance(text, str) else f"{param}.{i}"
                raise InvalidRequestError(
                    f"{where} has {len(t)} characters; no text over {self.max_prompt_chars} "
                    f"fits the context of {self.context_len} tokens",
                    where,
                )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._encode, texts)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer(t)["input_ids"] if t else [] for t in texts]

    async def apply_chat_template(
        self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"messages have {chars} characters; no text over {self.max_prompt_chars} fits "
                f"the context of {self.context_len} tokens",
                "messages",
            )

        def render() -> list[int]:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
            )
            return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)

        return await asyncio.get_running_loop().run_in_executor(self.pool, render)

    def token_text(self, token: int) -> str:
        """A token's text (remembered: logprob entries show it on every streamed chunk)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:12]}-{next(self._counter)}"

    def check(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None,
        logprob_start_len: int = -1,
    ) -> None:
        """Raise InvalidRequestError for a request that can never run (before it is queued,
        so that a batch is refused whole and a stream before its headers)."""
        check_request(
            input_ids,
            params,
            self.vocab_size,
            self.context_len,
            self.num_kv_slots,
            logprob_start_len,
        )
        if rid is not None and rid in self.states:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "rid")

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        group: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[ReqState]:
        """Yields the request's state after every update (without `stream`, the scheduler sends
        one, when it finishes); the last one is finished. Leaving the iteration early (a client
        that went away, a sibling that failed) aborts the request.
        The caller has run `check` on it (every element of a batch before any starts); the
        scheduler checks again and rejects what got past."""
        if rid is not None and rid in self.states:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "rid")
        rid = rid or self.new_rid()
        state = ReqState(rid, len(input_ids), return_logprob, top_logprobs_num)
        self.states[rid] = state
        try:
            await asend_message(
                self.to_scheduler,
                TokenizedRequest(
                    rid,
                    list(input_ids),
                    sampling_params,
                    return_logprob,
                    top_logprobs_num,
                    logprob_start_len,
                    group,
                    stream,
                ),
            )
            while True:
                update = await state.updates.get()
                if isinstance(update, Exception):
                    raise update
                yield state
                if state.finished:
                    return
        finally:
            self.states.pop(rid, None)
            if not state.finished:
                await asend_message(self.to_scheduler, AbortReq(rid))

    async def abort(self, rid: str) -> None:
        await asend_message(self.to_scheduler, AbortReq(rid))

    async def control(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        call_id = self.new_rid()
        future = asyncio.get_running_loop().create_future()
        self.calls[call_id] = future
        await asend_message(self.to_scheduler, ControlReq(call_id, name))
        return await asyncio.wait_for(future, timeout)
