"""The scheduler loop: admit waiting requests, prefill them, decode the running batch, finish.

The scheduler owns every decision and all bookkeeping: which KV slots and table row belong to
which request. The worker only runs the batches it is given.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Protocol

from spectral.forward import ForwardMode
from spectral.mem.allocator import TokenSlotAllocator
from spectral.sampling_params import InvalidRequestError
from spectral.scheduler.req import FinishReason, Req
from spectral.scheduler.schedule_batch import ScheduleBatch
from spectral.worker.io import WorkerBatch, WorkerResult

logger = logging.getLogger(__name__)


class Worker(Protocol):
    def forward(self, batch: WorkerBatch) -> WorkerResult: ...


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Scheduler:
    def __init__(
        self,
        worker: Worker,
        tokenizer: Detokenizer,
        num_kv_slots: int,
        max_running_requests: int,
        max_context_len: int,
        max_prefill_tokens: int,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
    ) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.allocator = TokenSlotAllocator(num_kv_slots)
        self.free_rows: list[int] = list(range(max_running_requests - 1, -1, -1))
        self.max_running_requests = max_running_requests
        self.max_context_len = max_context_len
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reserved_tokens = 0

    # ---- requests in -------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Validate and queue. Raises InvalidRequestError for a request that can never run."""
        n = len(req.input_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give a non-empty text or input_ids")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"input_ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if n >= self.max_context_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens; the context length is {self.max_context_len}, "
                f"so prompts may have at most {self.max_context_len - 1}"
            )
        req.sampling_params.validate(self.vocab_size)
        needed = n + self._max_output(req)
        if needed > self.allocator.num_slots:
            raise InvalidRequestError(
                f"the request needs {needed} tokens of KV cache (prompt {n} + max_new_tokens), "
                f"the pool holds {self.allocator.num_slots}; lower max_new_tokens or raise "
                "--max-total-tokens"
            )
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Finish request `rid` with reason abort, wherever it is. False if unknown."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = FinishReason("abort")
                req.finished_at = time.perf_counter()
                return True
        for req in self.running:
            if req.rid == rid:
                self._finish(req, FinishReason("abort"))
                self.running = [r for r in self.running if not r.finished]
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Run one batch. Returns the requests that received a token (finished ones included)."""
        batch = self._next_batch()
        if batch is None:
            return []
        banned = {
            req.rid: self._stop_ids(req)
            for req in batch.reqs
            if len(req.output_ids) < req.sampling_params.min_new_tokens
        }
        result = self.worker.forward(batch.to_worker_batch(banned))
        self._process_result(batch, result)
        return batch.reqs

    def _max_output(self, req: Req) -> int:
        return min(req.sampling_params.max_new_tokens, self.max_context_len - len(req.input_ids))

    def _next_batch(self) -> ScheduleBatch | None:
        admitted = self._admit()
        if admitted:
            return ScheduleBatch(ForwardMode.EXTEND, admitted)
        if not self.running:
            return None
        for req in self.running:
            req.kv_slots.extend(self.allocator.alloc(1))
            req.reserved_tokens -= 1
            self.reserved_tokens -= 1
        return ScheduleBatch(ForwardMode.DECODE, list(self.running))

    def _admit(self) -> list[Req]:
        """FCFS admission while a row, the prefill budget and the reserved KV allow.

        Each admitted request reserves slots for its whole output, so decode never runs short.
        """
        admitted: list[Req] = []
        prefill_tokens = 0
        while self.waiting and self.free_rows:
            req = self.waiting[0]
            n = len(req.input_ids)
            max_out = self._max_output(req)
            if max_out == 0:
                self.waiting.popleft()
                self._finish(req, FinishReason("length", length=0))
                continue
            if admitted and prefill_tokens + n > self.max_prefill_tokens:
                break
            if n + max_out > self.allocator.free_count - self.reserved_tokens:
                break
            self.waiting.popleft()
            req.req_pool_idx = self.free_rows.pop()
            req.kv_slots = self.allocator.alloc(n)
            req.reserved_tokens = max_out
            self.reserved_tokens += max_out
            prefill_tokens += n
            admitted.append(req)
            self.running.append(req)
        return admitted

    def _process_result(self, batch: ScheduleBatch, result: WorkerResult) -> None:
        for i, req in enumerate(batch.reqs):
            token = result.next_token_ids[i]
            req.output_ids.append(token)
            if req.return_logprob:
                req.output_logprobs.append(result.logprobs[i])
            if req.top_logprobs_num:
                req.output_top_logprobs.append(result.top_logprobs[i])
            reason = self._check_finish(req)
            if reason is not None:
                self._finish(req, reason)
        self.running = [r for r in self.running if not r.finished]

    def _stop_ids(self, req: Req) -> list[int]:
        ids = list(req.sampling_params.stop_token_ids)
        if not req.sampling_params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids

    def _check_finish(self, req: Req) -> FinishReason | None:
        p = req.sampling_params
        token = req.output_ids[-1]
        if len(req.output_ids) >= p.min_new_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                return FinishReason("stop", matched=token)
            if p.stop:
                reason = self._match_stop_string(req)
                if reason is not None:
                    return reason
        if len(req.output_ids) >= self._max_output(req):
            return FinishReason("length", length=len(req.output_ids))
        return None

    def _match_stop_string(self, req: Req) -> FinishReason | None:
        p = req.sampling_params
        longest = max(len(s) for s in p.stop)
        tail_ids = req.output_ids[-(longest + 2) :]
        tail = self.tokenizer.decode(tail_ids, skip_special_tokens=p.skip_special_tokens)
        for stop in p.stop:
            if stop in tail:
                text = self.tokenizer.decode(
                    req.output_ids, skip_special_tokens=p.skip_special_tokens
                )
                req.stop_text_cut = text.find(stop) if not p.no_stop_trim else None
                return FinishReason("stop", matched=stop)
        return None

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """Mark finished and give back its KV slots, its row and its unused reservation."""
        req.finished_reason = reason
        req.finished_at = time.perf_counter()
        if req.kv_slots:
            self.allocator.free(req.kv_slots)
            req.kv_slots = []
        if req.req_pool_idx is not None:
            self.free_rows.append(req.req_pool_idx)
            req.req_pool_idx = None
        self.reserved_tokens -= req.reserved_tokens
        req.reserved_tokens = 0
