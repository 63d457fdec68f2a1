"""The scheduler loop: admit waiting requests into prefill batches, decode the running batch or
run a speculative round, retract when KV runs out, finish requests. It owns every decision and
all bookkeeping; the worker runs the batches it is given. Its parts: `KVManager`,
`PrefillAdder`, `GrammarIntake`, `FinishChecker`, `ResultIntake` and `SpecRound`."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from spectral import faults
from spectral.args import ServerArgs
from spectral.core.forward import ForwardMode
from spectral.core.model import ResolvedModel
from spectral.core.req import FinishReason, Req, check_request
from spectral.core.worker_io import WorkerResult
from spectral.faults import WorkerLostError
from spectral.scheduler.config import SchedulerConfig
from spectral.scheduler.finish import FinishChecker
from spectral.scheduler.grammar_intake import GrammarIntake
from spectral.scheduler.kv_manager import KVManager
from spectral.scheduler.output import ResultIntake, SchedulerStats
from spectral.scheduler.overlap import DecodeOverlap
from spectral.scheduler.prefill import PrefillAdder, fan_out_victim, mix_running, order_waiting
from spectral.scheduler.schedule_batch import ScheduleBatch
from spectral.speculative.settings import SpecSettings
from spectral.speculative.sources.round import SpecRound
from spectral.worker.base import Worker
from spectral.worker.grammar_follower import GrammarFollower

logger = logging.getLogger(__name__)

# The share of running requests' remaining output reserved at admission starts here, decays
# each decode step towards the minimum, and goes back up when a retraction shows it was low.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_HEADROOM_STEPS = 20


class Scheduler:
    def __init__(
        self, worker: Worker, tokenizer: Any, config: SchedulerConfig, spec: SpecSettings | None
    ) -> None:
        """`tokenizer` decodes stop strings, encodes grammar-forced text; `spec`: rounds on."""
        self.worker = worker
        self.config = config
        self.spec = spec
        self.kv = KVManager(
            config.num_kv_slots,
            config.max_running_requests,
            config.disable_radix_cache,
            draft_kv_shift=spec is not None and spec.kv_pairs_next_token,
        )
        self.spec_round: SpecRound | None = None
        if spec is not None:
            self.spec_round = SpecRound(spec, worker.cost_model, tokenizer, config.max_context_len)
        self.grammars = GrammarIntake(
            tokenizer,
            config.vocab_size,
            config.eos_token_ids,
            config.grammar_compile_timeout,
            worker.grammar_ready if spec is not None else None,  # a speculative one follows
            config.grammar_cache_bytes,
        )
        self.finish = FinishChecker(tokenizer, config.eos_token_ids, config.max_context_len)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.last_mode: ForwardMode | None = None
        self.stats = SchedulerStats()
        self.intake = ResultIntake(self.finish, self.kv, self.stats, self.spec_round)
        pipeline = getattr(worker, "pipeline", None)  # a worker that launches steps ahead
        self.overlap: DecodeOverlap | None = None
        if config.overlap_schedule and spec is None and pipeline is not None:
            self.overlap = DecodeOverlap(self, pipeline)

    # ---- requests in -------------------------------------------------------------------------

    def validate(self, req: Req) -> None:
        """Raise InvalidRequestError for a request that can never run. Reads only settings."""
        c = self.config
        logprob_start = req.logprob_start_len if req.return_logprob else -1
        check_request(
            req.input_ids,
            req.sampling_params,
            c.vocab_size,
            c.max_context_len,
            c.num_kv_slots,
            logprob_start,
        )

    def add_request(self, req: Req) -> None:
        """Queue a request; one whose grammar is not compiled yet waits in the grammar intake
        until it is (or, where xgrammar cannot compile it, is refused: `grammars.take_rejected`)."""
        self.validate(req)
        if not self.grammars.needs_compile(req):
            self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        """Finish request `rid` with reason abort wherever it is, releasing its KV (computed
        tokens are cached). Returns the request, or None if it is unknown or done."""
        req = self.grammars.remove(rid)
        if req is None and self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
        for queue in (self.waiting, self.running):
            found = next((r for r in queue if r.rid == rid), None) if req is None else None
            if found is not None:
                queue.remove(found)
                req = found
        if req is not None:
            self._finish(req, FinishReason("abort"))
        return req

    @property
    def has_work(self) -> bool:
        busy = self.overlap is not None and self.overlap.busy
        return bool(self.waiting or self.running or self.chunked or self.grammars.compiling or busy)

    def flush_cache(self) -> bool:
        """Empty the radix cache and the n-gram index of past requests; only when idle
        (returns False otherwise)."""
        if self.has_work:
            return False
        self.kv.tree.reset()
        if self.spec_round is not None:
            self.spec_round.flush()
        return True

    def info(self) -> dict:
        """What /get_server_info reports of the scheduler: memory, queues, counters, and with
        speculation its cost model, acceptance by rank, the last plan and predicted against
        measured gains."""
        out = {
            "memory": self.kv.memory() | {"kv_pool": self.worker.kv_pool_info()},
            "caches": self._caches(),
            "requests": {
                "running": len(self.running) + (1 if self.chunked else 0),
                "waiting": len(self.waiting),
            },
            "stats": self.stats.to_dict(),
        }
        if self.spec_round is not None:
            out["speculative"] = self.spec_round.info()
        graphs = self.worker.graph_info()
        if graphs is not None:
            out["cuda_graph"] = graphs
        return out

    def _caches(self) -> dict:
        """Every cache besides the KV pool's radix tree, with its size and bound."""
        out: dict = {"grammars": self.grammars.cache_info()}
        ngram = self.spec_round.ngram if self.spec_round is not None else None
        if ngram is not None:
            out["ngram_index"] = {
                "tokens": ngram.num_indexed_tokens,
                "max_tokens": ngram.max_indexed_tokens,
                "bytes": ngram.index.nbytes,  # claimed when the server starts
            }
        if ngram is not None and ngram.datastore is not None:
            store = ngram.datastore  # read through pread: its pages are the page cache's
            out["datastore"] = {
                "path": str(store.path),
                "tokens": store.manifest["tokens"],
                "bytes": store.nbytes,
                "resident_bytes": store.index_bytes,  # the sampled index, held in memory
            }
        return out

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Run one batch. Returns the requests whose output changed (finished ones included)."""
        if self.overlap is not None and self.overlap.busy:  # a step out: take it in
            return self.overlap.advance()
        if self.grammars.compiling:
            idle = not (self.waiting or self.running or self.chunked)
            self.grammars.take_compiled(idle, self.waiting.append)
        started = time.perf_counter()  # the planner weighs whole steps, host work included
        batch = self._next_batch()
        if batch is None:
            return []
        self.last_mode = batch.mode
        if self.overlap is not None and self.overlap.start(batch):
            return []
        changed = self._run(batch)
        if self.spec_round is not None:
            elapsed = time.perf_counter() - started
            self.spec_round.record_step(batch.mode, len(batch.reqs), elapsed)
        return changed

    def _run(self, batch: ScheduleBatch) -> list[Req]:
        """Forward `batch` and take in its results. When the worker fails on it, the batch is
        split and run again in halves (a forward only rewrites the same slots) until the
        requests it fails on are alone; those finish as aborted with the error, the others
        go on. A speculative round is not rerun (the worker's draft state has moved), so
        all of its requests fail."""
        banned = self.finish.banned(batch.reqs)
        idle = self.spec_round is not None and self.spec_round.head_idle
        draft_next = self.spec is not None and self.spec.kv_pairs_next_token and not idle
        stale = [req.table_stale_from for req in batch.reqs]
        try:
            wb = batch.to_worker_batch(banned, draft_next)
            wb.drafter_idle = idle
            result = self.worker.forward(wb)
        except WorkerLostError:
            raise
        except Exception as err:
            for req, value in zip(batch.reqs, stale):
                req.table_stale_from = value  # the table rows may not have been written
            if len(batch.reqs) == 1 or batch.mode == ForwardMode.TARGET_VERIFY:
                logger.exception("the model worker failed on a batch of %d", len(batch.reqs))
                for req in batch.reqs:
                    self._fail(req, batch, faults.failure("model worker", err))
                return list(batch.reqs)
            half = len(batch.reqs) // 2
            return [
                req
                for part in (batch.reqs[:half], batch.reqs[half:])
                for req in self._run(ScheduleBatch(batch.mode, part, batch.decoding))
            ]
        return self._process_result(batch, result)

    def _fail(self, req: Req, batch: ScheduleBatch, message: str) -> None:
        """Finish `req` as aborted with `message`, keeping in the cache only the KV computed
        before this batch."""
        if req.finished:
            return
        if batch.mode == ForwardMode.TARGET_VERIFY:
            computed = req.seq_len
            self.kv.allocator.free(req.spec.slots)
            req.spec.slots = []
        else:
            computed = min(batch.new_token_range(req)[0], req.seq_len)
        self.kv.forget_after(req, computed)
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self._finish(req, FinishReason("abort", message=message))

    def _next_batch(self) -> ScheduleBatch | None:
        # After a prefill, decode once before the next prefill, so that long prompts
        # prefilled in chunks interleave with the running requests' decoding.
        if not (self.last_mode == ForwardMode.EXTEND and self.running):
            batch = self._prefill_batch()
            if batch is not None:
                return batch
        if self.running:
            return self._decode_batch()
        return self._prefill_batch()

    def _prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        adder = PrefillAdder(
            self.kv,
            self.running,
            self.finish.max_output,
            self.new_token_ratio,
            self.config.max_prefill_tokens,
            self.config.chunked_prefill_size,
            self.config.max_running_requests,
        )
        if self.chunked is not None:
            adder.add_chunked(self.chunked)
        queue = order_waiting(self.waiting, self.config.schedule_policy, self.kv, self.running)
        victim = fan_out_victim(self.running, queue[0]) if adder.slots_left <= 0 and queue else None
        if victim is not None:
            self._retract(victim)
            adder.slots_left += 1
        for req in queue:
            if adder.new_chunked is not None:
                break
            if adder.shares_uncached_prefix(req):
                continue
            if not adder.try_add(req):
                break
            self.waiting.remove(req)
            self.stats.cached_tokens += req.extend_start
        if not adder.admitted:
            return None
        self.chunked = adder.new_chunked
        mixed = mix_running(self.running, self.kv) if self.config.mixed_chunk else []
        return ScheduleBatch.prefill(adder.admitted, mixed)

    def _decode_batch(self) -> ScheduleBatch | None:
        """Every running request gets one slot for its newest token; when the pool runs
        short, evict cached prefixes, then retract requests (most remaining work first)."""
        if self.spec_round is not None and len(self.running) <= self.spec.max_batch_size:
            batch = self._verify_batch()
            if batch is not None:
                return batch
        kv = self.kv
        while kv.available < len(self.running) and len(self.running) > 1:
            self._retract_one()
        for req in self.running:
            req.kv_slots.extend(kv.take(req, 1))
        self.decay_new_token_ratio()
        self.stats.decode_steps += 1
        return ScheduleBatch(ForwardMode.DECODE, list(self.running))

    def _verify_batch(self) -> ScheduleBatch | None:
        """A speculative round: each running request gets one slot per node of the tree the
        SpecRound sizes (the root is its newest token); None where a plain decode step is
        expected to do better. When the pool cannot hold every tree, requests are retracted as
        for decode, and a last request verifies its root alone."""
        sizes = self.spec_round.plan(self.running)
        if sizes is None:
            return None
        kv = self.kv
        sizes_of = {req.rid: size for req, size in zip(self.running, sizes)}
        while kv.available < sum(sizes_of[r.rid] for r in self.running) and len(self.running) > 1:
            self._retract_one()
        if kv.available < sum(sizes_of[r.rid] for r in self.running):
            for req in self.running:
                sizes_of[req.rid] = 1
                req.spec.draft_tokens, req.spec.draft_parents = [], []
        for req in self.running:
            req.spec.slots = kv.take(req, sizes_of[req.rid])
        self.spec_round.record_plan([sizes_of[r.rid] for r in self.running])
        self.stats.decode_steps += 1
        self.decay_new_token_ratio()
        return ScheduleBatch(ForwardMode.TARGET_VERIFY, list(self.running))

    def decay_new_token_ratio(self) -> None:
        """A decode step or round: the reserve for running requests' output shrinks."""
        ratio = self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, ratio)

    def _retract_one(self) -> None:
        victim = max(
            self.running,
            key=lambda r: (r.remaining_new_tokens(self.finish.max_output(r)), -len(r.input_ids)),
        )
        self._retract(victim)
        decoded = sum(len(r.output_ids) for r in self.running)
        budget = sum(self.finish.max_output(r) for r in self.running) or 1
        ratio = (decoded + RETRACT_HEADROOM_STEPS * len(self.running)) / budget
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, ratio))
        logger.info(
            "KV cache full: retracted request %s (%d tokens) back to the queue",
            victim.rid,
            len(victim.all_ids),
        )

    def _retract(self, victim: Req) -> None:
        """Back to the front of the queue; its computed tokens stay in the radix cache."""
        self.running.remove(victim)
        self.kv.release(victim)
        victim.retraction_count += 1
        self.waiting.appendleft(victim)
        self.stats.retractions += 1

    def _process_result(self, batch: ScheduleBatch, result: WorkerResult) -> list[Req]:
        """Take in each request's part of `result`; a request whose part fails is finished as
        aborted with the error, and the others go on."""
        changed: list[Req] = []
        for i, req in enumerate(batch.reqs):
            if req.finished:  # aborted, or done before a step launched ahead (DecodeOverlap)
                continue
            try:
                faults.inject("scheduler", req.rid)
                verdict = self.intake.take(batch, result, i, req)
            except Exception as err:
                logger.exception("taking in the result of request %s failed", req.rid)
                self._fail(req, batch, faults.failure("scheduler", err))
                changed.append(req)
                continue
            if verdict.finished is not None:
                if req in self.running:
                    self.running.remove(req)
                self._finish(req, verdict.finished)
            elif batch.prefills(req) and verdict.changed:
                self.kv.cache_unfinished(req)
                self.running.append(req)
            if verdict.changed:
                changed.append(req)
        return changed

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """Mark finished and release its KV (computed tokens go to the radix cache)."""
        req.finished_reason = reason
        req.finished_at = time.perf_counter()
        self.kv.release(req)
        if self.spec_round is not None:
            self.spec_round.finished(req, reason)


def build_scheduler(args: ServerArgs, model: ResolvedModel, worker: Worker, tok: Any) -> Scheduler:
    """The scheduler `args` describe over `worker` (the Engine's and the scheduler process's)."""
    scheduler = Scheduler(
        worker, tok, SchedulerConfig.of(args, model, worker.num_kv_slots), args.spec
    )
    if worker.grammars is not None:  # a worker in this process follows with our compiler
        worker.grammars = GrammarFollower(scheduler.grammars.backend)
    return scheduler
