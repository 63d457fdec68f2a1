"""DecodeOverlap: plain decode steps launched one ahead of their results (SGLang's overlap
scheduler, for plain decoding). While the device runs step N, the scheduler has already built
and launched step N + 1 for the requests that go on after N, each one's input the token step N
samples for it (named by its row; the worker resolves it on the device). Then step N's tokens
are taken in as usual; a request that finished at N leaves step N + 1 (its row there computed
for nothing, its slot freed). The device does not wait for the host between steps.

It runs only where nothing in a step needs the host: the worker launches steps
(`worker.pipeline`), no speculation, and every request greedy or sampled (seeded or not)
without penalties, grammar, logprobs or banned tokens. While a request waits to be admitted
nothing more is launched: the step out is taken in, and the scheduler goes on as without."""

from __future__ import annotations

import logging
from typing import Any

from spectral.core.forward import ForwardMode
from spectral.core.req import Req
from spectral.faults import WorkerLostError
from spectral.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class DecodeOverlap:
    def __init__(self, scheduler: Any, pipeline: Any) -> None:
        self.s = scheduler  # the Scheduler it serves (its module imports this one)
        self.pipeline = pipeline  # the worker's: launch(WorkerBatch), collect() -> WorkerResult
        self.out: ScheduleBatch | None = None  # the step launched, its tokens not taken in
        self.next_slots: list[int] = []  # the slots of the step launched after it, if any

    @property
    def busy(self) -> bool:
        return self.out is not None

    def start(self, batch: ScheduleBatch) -> bool:
        """Launch `batch` where it qualifies and return True (its tokens are taken in by the
        next `advance`); else False, and the scheduler runs it as usual."""
        if batch.mode != ForwardMode.DECODE or not self._qualifies(batch.reqs, 0):
            return False
        stale = [req.table_stale_from for req in batch.reqs]
        try:
            self.pipeline.launch(batch.to_worker_batch({}))
        except Exception:  # the scheduler runs it instead, and deals with the error
            for req, value in zip(batch.reqs, stale):
                req.table_stale_from = value
            return False
        self.out = batch
        return True

    def advance(self) -> list[Req]:
        """Launch the step after the one out where it qualifies, then take the one out in.
        Returns the requests whose output changed."""
        batch = self.out
        assert batch is not None
        follow = self._launch_follow(batch)
        try:
            result = self.pipeline.collect()
        except WorkerLostError:
            raise
        except Exception:  # run again the usual way, which finds the requests it fails on
            logger.exception("a decode step launched ahead failed; running it again")
            self._drop(follow)
            self.out = None
            live = [req for req in batch.reqs if not req.finished]
            return self.s._run(ScheduleBatch(batch.mode, live)) if live else []
        changed = self.s._process_result(batch, result)
        self.out = None
        if follow is not None:
            for req, slot in zip(follow.reqs, self.next_slots):
                if req.finished:  # at step N: its row of N + 1 is computed for nothing
                    self.s.kv.allocator.free([slot])
                else:
                    req.kv_slots.append(slot)
            self.next_slots = []
            self.out = follow  # its finished requests are skipped when it is taken in
        return changed

    def _launch_follow(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        """The step after `batch` for its requests that go on after it, launched (their slots
        in `next_slots`), or None where none qualifies or a request waits to be admitted."""
        s = self.s
        if s.waiting or s.chunked is not None or s.grammars.compiling:
            return None
        reqs = [
            req
            for req in batch.reqs
            if not req.finished and req.remaining_new_tokens(s.finish.max_output(req)) > 1
        ]
        if not reqs or s.kv.available < len(reqs) or not self._qualifies(reqs, 1):
            return None
        rows = {id(req): i for i, req in enumerate(batch.reqs)}
        slots = [slot for req in reqs for slot in s.kv.take(req, 1)]
        follow = ScheduleBatch(ForwardMode.DECODE, reqs)
        try:
            self.pipeline.launch(follow.to_follow_batch([rows[id(r)] for r in reqs], slots))
        except Exception:  # taken in first; the scheduler then runs the requests as usual
            logger.exception("launching a decode step ahead failed")
            s.kv.allocator.free(slots)
            return None
        self.next_slots = slots
        s.stats.decode_steps += 1
        s.stats.decode_steps_ahead += 1
        s.decay_new_token_ratio()
        return follow

    def _drop(self, follow: ScheduleBatch | None) -> None:
        """A step launched ahead that is given up: collected for nothing, its slots freed."""
        if follow is None:
            return
        try:
            self.pipeline.collect()
        except Exception:  # noqa: BLE001 - the device is failing already; nothing to keep
            pass
        self.s.kv.allocator.free(self.next_slots)
        self.next_slots = []

    def _qualifies(self, reqs: list[Req], ahead: int) -> bool:
        """Whether every request's step, `ahead` tokens past its output, needs nothing from
        the host: no grammar, penalties, logprobs or tokens banned before min_new_tokens."""
        for req in reqs:
            p = req.sampling_params
            if req.grammar is not None or p.has_penalties:
                return False
            if req.return_logprob or req.top_logprobs_num:
                return False
            if len(req.output_ids) + ahead < p.min_new_tokens:
                return False
        return True
