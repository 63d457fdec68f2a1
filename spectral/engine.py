"""Engine: the offline entry point. Same scheduler and worker as the server, in one process."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from spectral import faults
from spectral.args import ServerArgs
from spectral.core.req import Req
from spectral.logprobs import logprob_meta
from spectral.mem.process import freeze_heap, thaw_heap
from spectral.models.resolved import resolve_model
from spectral.sampling_params import InvalidRequestError, SamplingParams
from spectral.scheduler.scheduler import build_scheduler
from spectral.server.worker_process import RemoteWorker
from spectral.worker.factory import create_worker

logger = logging.getLogger(__name__)

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None


class Engine:
    """`Engine(model_path="default", dtype="auto", **server_args)`; see `ServerArgs` for options."""

    def __init__(self, model_path: str = "default", dtype: str = "auto", **kwargs: Any) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_path, dtype=dtype, **kwargs)
        if self.args.fault_injection is not None:
            faults.enable(self.args.fault_injection)
        args = self.args
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        self.model, self.tokenizer = resolve_model(args)
        self._ipc_dir: str | None = None
        if args.tp_size > 1:
            # the ranks are processes: the server's worker process is rank 0 and starts the
            # others (docs/internals.md, "Tensor parallelism")
            self._ipc_dir = tempfile.mkdtemp(prefix="spectral-")  # mode 0700
            self.worker = RemoteWorker(args, self._ipc_dir)
            try:
                self.worker.hand_model(self.model).wait_ready()
            except BaseException:
                self._close_worker()
                raise
        else:
            self.worker = create_worker(args, self.model)
        self.scheduler = build_scheduler(args, self.model, self.worker, self.tokenizer)
        self._rid_counter = itertools.count()
        self._start_loop()
        freeze_heap()  # thawed at shutdown

    # ---- driving the scheduler -----------------------------------------------------------------
    # Whoever waits for results drives: a caller of generate() runs scheduler steps itself while
    # it holds the driver lock (kernels run fastest on the thread that made their OpenMP team;
    # docs/internals.md). Other callers' requests advance in the same steps. async_generate
    # starts a background driver thread; `step` is one step for a caller driving it by hand.

    def _start_loop(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._driver = threading.Lock()
        self._listeners: dict[str, Callable[[Req, BaseException | None], None]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def _tick(self) -> None:
        """One round: take in new requests and aborts, run one step. Hold `_driver` to call."""
        self._drain_inbox()
        if not self.scheduler.has_work:
            return
        try:
            changed = self.scheduler.step()
        except Exception as err:  # a bug must fail the requests, not hang their callers
            logger.exception("scheduler step failed")
            self._fail_all(err)
            return
        for req in changed:
            self._notify(req, None)

    def _drive_until(self, done: threading.Event) -> None:
        while not done.is_set():
            if not self._driver.acquire(timeout=0.02):
                continue  # another thread is driving; our requests advance with its steps
            try:
                while not done.is_set():
                    self._tick()
                    if not self.scheduler.has_work and self._inbox.empty():
                        break
            finally:
                self._driver.release()

    def _ensure_background_driver(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name="spectral-scheduler", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        """The background driver: steps while there is work, sleeps when idle."""
        while not self._closed:
            with self._driver:
                self._tick()
                idle = not self.scheduler.has_work and self._inbox.empty()
            if idle:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.waiting.append(payload)
            elif kind == "call":
                payload()
            elif kind == "abort":
                req = self.scheduler.abort(payload)
                if req is not None:
                    self._notify(req, None)

    def _notify(self, req: Req, error: BaseException | None) -> None:
        listener = self._listeners.get(req.rid)
        if listener is None:
            return
        if req.finished or error is not None:
            self._listeners.pop(req.rid, None)
        try:
            listener(req, error)
        except Exception:  # a caller gone away (closed event loop) must not stop the loop
            logger.exception("dropping the update of request %s", req.rid)
            self._listeners.pop(req.rid, None)
            if not req.finished:
                self.scheduler.abort(req.rid)

    def _fail_all(self, err: BaseException) -> None:
        s = self.scheduler
        stuck = list(s.waiting) + list(s.running) + ([s.chunked] if s.chunked else [])
        for req in stuck:
            s.abort(req.rid)
            self._notify(req, err)

    def _submit(
        self, reqs: list[Req], listener: Callable[[Req, BaseException | None], None]
    ) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        for req in reqs:
            self.scheduler.validate(req)
            self.scheduler.grammars.attach(req)
        for req in reqs:
            self._listeners[req.rid] = listener
            self._inbox.put(("add", req))
        self._wakeup.set()

    def abort(self, rid: str) -> None:
        """Abort a request by id, at any stage; its KV is cached or freed."""
        self._inbox.put(("abort", rid))
        self._wakeup.set()

    # ---- public API ----------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: InputIds = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a list of prompts run as one batch (a list).
        Requests from other threads join the same running batch."""
        reqs, single = self._make_reqs(
            prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, logprob_start_len
        )
        done, errors, pending = threading.Event(), [], {req.rid for req in reqs}

        def on_update(req: Req, error: BaseException | None) -> None:  # under the driver lock
            if error is not None:
                errors.append(error)
            if req.finished or error is not None:
                pending.discard(req.rid)
                if not pending:
                    done.set()

        self._submit(reqs, on_update)
        try:
            self._drive_until(done)
        except BaseException:
            for req in reqs:
                self.abort(req.rid)
            raise
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}") from errors[0]
        outputs = [self.output(req) for req in reqs]
        return outputs[0] if single else outputs

    def submit(
        self, prompt: Prompt = None, sampling_params: dict | None = None, input_ids: InputIds = None
    ) -> list[Req]:
        """Queue prompts without waiting: they advance with `step` (or anyone's `generate`);
        `output(req)` once `req.finished`. For a caller driving engines in turn (benchmarks)."""
        reqs, _ = self._make_reqs(prompt, input_ids, sampling_params, False, 0)
        self._submit(reqs, lambda req, error: None)
        return reqs

    def step(self) -> bool:
        """One scheduler step on the calling thread; whether work remains."""
        with self._driver:
            self._tick()
            return self.scheduler.has_work or not self._inbox.empty()

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """One request. With `stream`, yields an output after every new token (cumulative
        text and ids, as SGLang streams them); otherwise yields the final output once.
        Cancelling the iteration aborts the request."""
        if isinstance(prompt, list) or (input_ids and isinstance(input_ids[0], list)):
            raise InvalidRequestError("async_generate takes one prompt; call it once per prompt")
        reqs, _ = self._make_reqs(
            prompt, input_ids, sampling_params, return_logprob, top_logprobs_num
        )
        if len(reqs) > 1:
            raise InvalidRequestError("async_generate takes n = 1; use generate for n samples")
        req = reqs[0]
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[BaseException | None] = asyncio.Queue()

        def on_update(_: Req, error: BaseException | None) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(updates.put_nowait, error)

        self._submit([req], on_update)
        self._ensure_background_driver()
        try:
            while True:
                error = await updates.get()
                if error is not None:
                    raise RuntimeError(f"generation failed: {error}") from error
                if req.finished or stream:
                    yield self.output(req)
                if req.finished:
                    return
        finally:
            if not req.finished:
                self.abort(req.rid)

    def _make_reqs(
        self,
        prompt: Prompt,
        input_ids: InputIds,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        return_logprob: bool,
        top_logprobs_num: int,
        logprob_start_len: int = -1,
    ) -> tuple[list[Req], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else list(prompt)
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequestError("prompt must be a string or a list of strings")
            if not texts:
                raise InvalidRequestError("the prompt list is empty")
            if any(t == "" for t in texts):
                raise InvalidRequestError("the prompt is empty: give a non-empty text or input_ids")
            token_lists = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            single = not input_ids or isinstance(input_ids[0], int)
            token_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
            for ids in token_lists:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise InvalidRequestError(
                        "input_ids must be a list of integers (or a list of such lists)"
                    )
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(token_lists):
                raise InvalidRequestError(
                    f"{len(sampling_params)} sampling_params for {len(token_lists)} prompts"
                )
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params) for _ in token_lists]
        if top_logprobs_num < 0:
            raise InvalidRequestError(f"top_logprobs_num must be >= 0 (got {top_logprobs_num})")
        # n samples per prompt, prompt by prompt (SGLang's order); n > 1 answers a list
        reqs = [
            Req(
                rid=f"{uuid.uuid4().hex[:8]}-{next(self._rid_counter)}",
                input_ids=ids,
                sampling_params=p.for_sample(k),
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
            )
            for ids, p in zip(token_lists, params)
            for k in range(p.n)
        ]
        return reqs, single and len(reqs) == 1

    def output(self, req: Req) -> dict[str, Any]:
        """A request's output as `generate` gives it (so far, where it has not finished)."""
        p = req.sampling_params
        text = p.decode(self.tokenizer, req.output_ids)
        if req.stop_text_cut is not None:
            text = text[: req.stop_text_cut]
        if not req.finished:
            # a streamed chunk may end inside a multi-byte character: show it when complete
            text = text.rstrip("\ufffd")
        meta: dict[str, Any] = {
            "id": req.rid,
            **req.usage(),
            "finish_reason": req.finished_reason.to_dict() if req.finished_reason else None,
            "e2e_latency": (req.finished_at or time.perf_counter()) - req.created_at,
        }
        if req.return_logprob:
            meta |= logprob_meta(
                req.input_token_logprobs(),
                list(zip(req.output_logprobs, req.output_ids)),
                req.output_top_logprobs if req.top_logprobs_num else None,
            )
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    def get_server_info(self) -> dict[str, Any]:
        gguf = self.model.gguf_file is not None
        return {
            "model_path": self.args.model_path,
            "context_length": self.model.context_len,
            "quantization": self.args.resolved_quantization(gguf),
            "dtype": str(self.args.resolved_dtype(gguf)).removeprefix("torch."),
            **self.scheduler.info(),
        }

    def flush_cache(self) -> bool:
        """Empty the radix cache. Only when idle: returns False while requests are in flight."""
        done, result = threading.Event(), [False]

        def flush() -> None:
            result[0] = self.scheduler.flush_cache()
            done.set()

        self._inbox.put(("call", flush))
        self._wakeup.set()
        self._drive_until(done)
        return result[0]

    def shutdown(self) -> None:
        """Abort what is in flight and stop the scheduler thread."""
        if self._closed:
            return
        for rid in list(self._listeners):
            self.abort(rid)
        with self._driver:
            self._tick()
        self._closed = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close_worker()
        thaw_heap()  # this engine's cycles collectable again (other engines' too, until frozen)

    def _close_worker(self) -> None:
        """Stop the tensor-parallel ranks' processes, if any, and remove their sockets' dir."""
        if self._ipc_dir is not None:
            self.worker.close()
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
