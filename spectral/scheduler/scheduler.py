"""The scheduler loop: admit waiting requests into prefill batches (sharing cached prefixes,
chunking long prompts), decode the running batch, retract when KV runs out, finish requests.

The scheduler owns every decision and all bookkeeping (slots, rows, the radix tree, queues);
the worker only runs the batches it is given.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from spectral import faults
from spectral.faults import WorkerLostError
from spectral.forward import ForwardMode
from spectral.sampling_params import InvalidRequestError, SamplingParams
from spectral.scheduler.kv_manager import KVManager
from spectral.scheduler.prefill import PrefillAdder, order_waiting
from spectral.scheduler.req import FinishReason, Req
from spectral.scheduler.schedule_batch import ScheduleBatch
from spectral.speculative.ngram import NgramDrafter, NgramState
from spectral.speculative.planner import (
    PlanInput,
    TreePlanner,
    head_bucket,
    ngram_bucket,
)
from spectral.speculative.settings import SpecSettings
from spectral.speculative.tree import merge_tree_nodes
from spectral.worker.io import WorkerBatch, WorkerResult

if TYPE_CHECKING:
    from spectral.constrained import GrammarBackend

logger = logging.getLogger(__name__)

# The share of running requests' remaining output reserved at admission starts here, decays
# each decode step towards the minimum, and goes back up when a retraction shows it was low.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_HEADROOM_STEPS = 20
# With only grammars compiling, how long a step waits for one to finish.
COMPILE_POLL_S = 0.005


class Worker(Protocol):
    def forward(self, batch: WorkerBatch) -> WorkerResult: ...


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class SchedulerStats:
    prefill_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens taken from the radix cache
    generated_tokens: int = 0
    decode_steps: int = 0
    retractions: int = 0
    spec_verify_ct: int = 0  # speculative rounds, summed over requests
    spec_emitted_tokens: int = 0  # tokens those rounds produced (accepted drafts + 1 each)

    @property
    def spec_accept_length(self) -> float:
        """Average tokens per speculative round and request (SGLang's accept length)."""
        return self.spec_emitted_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "spec_accept_length": self.spec_accept_length}


def check_request(
    input_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_context_len: int,
    num_kv_slots: int,
    logprob_start_len: int = -1,
) -> None:
    """Raise InvalidRequestError for a request that can never run: an empty or too long
    prompt, ids outside the vocabulary, parameters out of range, more KV than the pool has,
    prompt logprobs asked from past the prompt's end. The scheduler checks every request; the
    server checks before it queues one too."""
    n = len(input_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty: give a non-empty text or input_ids")
    if logprob_start_len >= n:
        raise InvalidRequestError(
            f"logprob_start_len: {logprob_start_len} is not below the prompt's {n} tokens",
            "logprob_start_len",
        )
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"input_ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})", "input_ids"
        )
    if n >= max_context_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens; the context length is {max_context_len}, "
            f"so prompts may have at most {max_context_len - 1}"
        )
    params.validate(vocab_size)
    needed = n + min(params.max_new_tokens, max_context_len - n)
    if needed > num_kv_slots:
        raise InvalidRequestError(
            f"the request needs {needed} tokens of KV cache (prompt {n} + max_new_tokens), "
            f"the pool holds {num_kv_slots}; lower max_new_tokens or raise --max-total-tokens",
            "max_new_tokens",
        )


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
        chunked_prefill_size: int | None = None,
        schedule_policy: str = "fcfs",
        disable_radix_cache: bool = False,
        spec: SpecSettings | None = None,
    ) -> None:
        if schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm (got {schedule_policy!r})")
        self.worker = worker
        self.tokenizer = tokenizer
        self.spec = spec
        self.kv = KVManager(
            num_kv_slots,
            max_running_requests,
            disable_radix_cache,
            draft_kv_shift=spec is not None and spec.uses_draft_head,
        )
        self.ngram: NgramDrafter | None = None
        if spec is not None and spec.uses_ngram:
            max_nodes, max_depth = spec.ngram_tree_shape
            self.ngram = NgramDrafter(
                max_nodes=max_nodes,
                max_depth=max_depth,
                min_ngram=spec.ngram_min_match,
                max_ngram=spec.ngram_max_match,
            )
        # Tree sizes from the worker's measured cost model (None: every request verifies
        # the settings' tree, up to the speculation batch limit).
        self.planner: TreePlanner | None = None
        cost = getattr(worker, "cost_model", None)
        if spec is not None and cost is not None and not spec.fixed_tree:
            self.planner = TreePlanner(cost, spec.num_steps)
        self.max_running_requests = max_running_requests
        self.max_context_len = max_context_len
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.schedule_policy = schedule_policy
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.last_mode: ForwardMode | None = None
        self.stats = SchedulerStats()
        from spectral.constrained import GrammarBackend, MadeAhead

        # The grammar compiler: made for the first request under a grammar, or ahead of it
        # (`start_grammar_backend`).
        self._grammars = MadeAhead(
            lambda: GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        )
        self.compiling: list[Req] = []  # requests whose grammar is being compiled
        self.rejected: list[tuple[str, str]] = []  # (rid, why): refused after add_request

    # ---- requests in -------------------------------------------------------------------------

    def validate(self, req: Req) -> None:
        """Raise InvalidRequestError for a request that can never run. Reads only settings."""
        check_request(
            req.input_ids,
            req.sampling_params,
            self.vocab_size,
            self.max_context_len,
            self.kv.allocator.num_slots,
            req.logprob_start_len if req.return_logprob else -1,
        )

    def add_request(self, req: Req) -> None:
        """Queue a request; one whose grammar is not compiled yet waits in `compiling` until
        it is (or, where xgrammar cannot compile it, is refused: `take_rejected`)."""
        self.validate(req)
        grammar = req.sampling_params.grammar
        if grammar is not None and req.grammar is None:
            self.grammar_backend().compile_later(*grammar)
            self.compiling.append(req)
            return
        self.waiting.append(req)

    def take_rejected(self) -> list[tuple[str, str]]:
        """(rid, why) of the requests refused since the last call: grammars xgrammar could
        not compile."""
        out, self.rejected = self.rejected, []
        return out

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar has compiled; refuse those whose grammar failed.
        With nothing else to do, wait a little for a compile to end."""
        backend = self.grammar_backend()
        compiles = [backend.compile_later(*r.sampling_params.grammar) for r in self.compiling]
        if not (self.waiting or self.running or self.chunked):
            wait(compiles, timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        pending = []
        for req, compiled in zip(self.compiling, compiles):
            if not compiled.done():
                pending.append(req)
                continue
            try:
                self.attach_grammar(req)
            except InvalidRequestError as err:
                req.finished_reason = FinishReason("abort", message=str(err))
                self.rejected.append((req.rid, str(err)))
                continue
            self.waiting.append(req)
        self.compiling = pending

    def grammar_backend(self) -> GrammarBackend:
        """The grammar compiler (and its cache)."""
        return self._grammars.get()

    def start_grammar_backend(self) -> None:
        """Make the grammar compiler on a thread now (about a second), instead of pausing every
        running request at the first request under a grammar."""
        self._grammars.start()

    def attach_grammar(self, req: Req) -> None:
        """Give a request with a regex, json_schema or ebnf its matcher (the grammar compiled
        once per distinct text; waits for the compile); InvalidRequestError where xgrammar
        cannot compile it."""
        grammar = req.sampling_params.grammar
        if grammar is not None and req.grammar is None:
            try:
                req.grammar = self.grammar_backend().matcher(
                    *grammar, req.sampling_params.stop_token_ids
                )
            except RuntimeError as err:
                from spectral.constrained import clean_error

                raise InvalidRequestError(
                    f"{grammar[0]}: xgrammar cannot compile it: {clean_error(err)}", grammar[0]
                ) from None

    def abort(self, rid: str) -> Req | None:
        """Finish request `rid` with reason abort wherever it is, releasing its KV (computed
        tokens are cached). Returns the request, or None if it is unknown or done."""
        for queue in (self.compiling, self.waiting):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._finish(req, FinishReason("abort"))
                    return req
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            self._finish(req, FinishReason("abort"))
            return req
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._finish(req, FinishReason("abort"))
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.compiling)

    def flush_cache(self) -> bool:
        """Empty the radix cache; only when idle (returns False otherwise)."""
        if self.has_work:
            return False
        self.kv.tree.reset()
        return True

    def info(self) -> dict:
        """What /get_server_info reports of the scheduler: memory, queues, counters, and with
        speculation its cost model, acceptance by rank, the last plan and predicted against
        measured gains."""
        out = {
            "memory": self.kv.memory(),
            "requests": {
                "running": len(self.running) + (1 if self.chunked else 0),
                "waiting": len(self.waiting),
            },
            "stats": self.stats.to_dict(),
        }
        if self.spec is not None:
            out["speculative"] = {
                "algorithm": self.spec.algorithm,
                "tree_policy": "fixed" if self.planner is None else "planned",
                "max_tree_nodes": self.spec.num_draft_tokens,
                **(self.planner.to_dict() if self.planner is not None else {}),
            }
        return out

    def max_output(self, req: Req) -> int:
        return min(req.sampling_params.max_new_tokens, self.max_context_len - len(req.input_ids))

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Run one batch. Returns the requests whose output changed (finished ones included)."""
        if self.compiling:
            self._admit_compiled()
        batch = self._next_batch()
        if batch is None:
            return []
        self.last_mode = batch.mode
        return self._run(batch)

    def _run(self, batch: ScheduleBatch) -> list[Req]:
        """Forward `batch` and take in its results. When the worker fails on it, the batch is
        split and run again in halves (a forward only rewrites the same slots) until the
        requests it fails on are alone; those finish as aborted with the error, the others
        go on. A speculative round is not rerun (the worker's draft state has moved), so
        all of its requests fail."""
        banned = {
            req.rid: self._stop_ids(req)
            for req in batch.reqs
            if len(req.output_ids) < req.sampling_params.min_new_tokens
        }
        draft_next = self.spec is not None and self.spec.uses_draft_head
        stale = [req.table_stale_from for req in batch.reqs]
        try:
            started = time.perf_counter()
            result = self.worker.forward(batch.to_worker_batch(banned, draft_next))
            if self.planner is not None and batch.mode != ForwardMode.EXTEND:
                self.planner.record_step(batch.mode, len(batch.reqs), time.perf_counter() - started)
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
                for req in self._run(ScheduleBatch(batch.mode, part))
            ]
        return self._process_result(batch, result)

    def _fail(self, req: Req, batch: ScheduleBatch, message: str) -> None:
        """Finish `req` as aborted with `message`, keeping in the cache only the KV computed
        before this batch."""
        if req.finished:
            return
        if batch.mode == ForwardMode.TARGET_VERIFY:
            computed = req.seq_len
            self.kv.allocator.free(req.spec_slots)
            req.spec_slots = []
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
            self.max_output,
            self.new_token_ratio,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            self.max_running_requests,
        )
        if self.chunked is not None:
            adder.add_chunked(self.chunked)
        queue = order_waiting(self.waiting, self.schedule_policy, self.kv, self.running)
        if adder.slots_left <= 0 and queue and self._make_room_for(queue[0]):
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
        return ScheduleBatch(ForwardMode.EXTEND, adder.admitted)

    def _make_room_for(self, req: Req) -> bool:
        """Every row is taken and `req`'s group has none: retract the newest request of the
        group holding the most rows, if it holds at least two, so that no client's fan-out
        keeps another client waiting for a whole generation. Returns whether it did."""
        groups: dict[str, list[Req]] = {}
        for other in self.running:
            groups.setdefault(other.group_key, []).append(other)
        if req.group_key in groups:
            return False
        largest = max(groups.values(), key=len, default=[])
        if len(largest) < 2:
            return False
        self._retract(min(largest, key=lambda r: (len(r.output_ids), -r.created_at)))
        return True

    def _decode_batch(self) -> ScheduleBatch | None:
        """Every running request gets one slot for its newest token; when the pool runs
        short, evict cached prefixes, then retract requests (most remaining work first)."""
        if self.spec is not None and len(self.running) <= self.spec.max_batch_size:
            batch = self._verify_batch()
            if batch is not None:
                return batch
        kv = self.kv
        while kv.available < len(self.running) and len(self.running) > 1:
            self._retract_one()
        for req in self.running:
            req.kv_slots.extend(kv.alloc_slots(1))
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        self.stats.decode_steps += 1
        return ScheduleBatch(ForwardMode.DECODE, list(self.running))

    def _verify_batch(self) -> ScheduleBatch | None:
        """A speculative round: each running request gets one slot per tree node (the root
        is its newest token). With a draft head, a request whose n-gram drafter matches
        (hybrid) takes the n-gram tree (merged: with the head's, slots for both) and the
        others the head's. The planner sizes each tree from the cost model (returning None
        where a plain decode step is expected to do better); without it every tree has the
        settings' size. A request's tree ends before its context does; when the pool cannot
        hold every tree, requests are retracted as for decode, and a last request verifies its
        root alone. NGRAM alone returns None when it has nothing for anyone (a plain decode
        step is cheaper than a round of roots)."""
        spec = self.spec
        kv = self.kv
        inputs: list[PlanInput] = []
        for req in self.running:
            room = self.max_context_len - req.seq_len
            size, kind = spec.num_draft_tokens, head_bucket(req.draft_top1)
            if self.ngram is not None:
                if req.ngram_state is None:
                    req.ngram_state = NgramState()
                tokens, parents = self.ngram.propose(req.all_ids, req.ngram_state)
                if tokens or not spec.uses_draft_head:
                    size = (size if spec.hybrid_merge else 1) + len(tokens)
                    kind = ngram_bucket(req.ngram_state.match_len)
                    req.draft_tokens, req.draft_parents = tokens[: room - 1], parents[: room - 1]
            req.spec_kind = kind
            inputs.append(
                PlanInput(kind, min(size, room), req.spec_accepted_tokens, req.spec_expected_drafts)
            )
        if self.planner is not None:
            plan = self.planner.plan(inputs)
            sizes = plan.nodes
        else:
            plan, sizes = None, [p.max_nodes for p in inputs]
        if (plan is not None and not plan.speculate) or (
            not spec.uses_draft_head and all(size == 1 for size in sizes)
        ):
            for req in self.running:
                req.draft_tokens = req.draft_parents = None
            return None
        for req, size in zip(self.running, sizes):
            if req.draft_tokens is not None:
                req.draft_tokens = req.draft_tokens[: size - 1]
                req.draft_parents = req.draft_parents[: size - 1]
        sizes = [size + self._add_forced_chain(req, size) for req, size in zip(self.running, sizes)]
        sizes_of = {req.rid: size for req, size in zip(self.running, sizes)}
        while kv.available < sum(sizes_of[r.rid] for r in self.running) and len(self.running) > 1:
            self._retract_one()
        if kv.available < sum(sizes_of[r.rid] for r in self.running):
            for req in self.running:
                sizes_of[req.rid] = 1
                req.draft_tokens, req.draft_parents = [], []
        for req in self.running:
            req.spec_slots = kv.alloc_slots(sizes_of[req.rid])
        if self.planner is not None:
            self.planner.record_plan(plan, [sizes_of[r.rid] for r in self.running])
        self.stats.decode_steps += 1
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        return ScheduleBatch(ForwardMode.TARGET_VERIFY, list(self.running))

    def _add_forced_chain(self, req: Req, size: int) -> int:
        """Give a request under a grammar the tokens of the text its grammar forces next (at
        most a tree's depth, within its context), as a chain from the root ahead of its planned
        tree's nodes (the worker's head tree joins them); returns the nodes added to `size`."""
        room = self.max_context_len - req.seq_len - size
        if req.grammar is None or not self.spec.grammar_drafts or room <= 0:
            return 0
        forced = req.grammar.forced_tokens(
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            min(self.spec.num_steps, room),
        )
        if not forced:
            return 0
        given = req.draft_tokens or []
        tokens, parents = merge_tree_nodes(
            forced, list(range(len(forced))), given, req.draft_parents or []
        )
        req.draft_tokens, req.draft_parents = tokens, parents
        return len(tokens) - len(given)

    def _retract_one(self) -> None:
        victim = max(
            self.running,
            key=lambda r: (r.remaining_new_tokens(self.max_output(r)), -len(r.input_ids)),
        )
        self._retract(victim)
        decoded = sum(len(r.output_ids) for r in self.running)
        budget = sum(self.max_output(r) for r in self.running) or 1
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
        take = self._take_verify if batch.mode == ForwardMode.TARGET_VERIFY else self._take
        changed: list[Req] = []
        for i, req in enumerate(batch.reqs):
            req.draft_top1 = result.draft_top1[i] if result.draft_top1 else None
            try:
                faults.inject("scheduler", req.rid)
                if take(batch, result, i, req):
                    changed.append(req)
            except Exception as err:
                logger.exception("taking in the result of request %s failed", req.rid)
                self._fail(req, batch, faults.failure("scheduler", err))
                changed.append(req)
        return changed

    def _take(self, batch: ScheduleBatch, result: WorkerResult, i: int, req: Req) -> bool:
        """Prefill or decode: append the sampled token (not for a prompt chunk) and finish or
        keep running the request. Returns whether its output changed."""
        if batch.mode == ForwardMode.EXTEND:
            self.stats.prefill_tokens += req.extend_len
            if req.wants_input_logprobs:
                if not req.input_logprobs:
                    req.input_logprobs.append(None)  # the first scored token has no context
                if result.input_logprobs:
                    req.input_logprobs.extend(result.input_logprobs[i])
            if not batch.completes_prefill(req):
                return False  # a chunk: its sampled token is meaningless
            if self.max_output(req) == 0:  # prefilled only: cached, or scored for logprobs
                self._finish(req, FinishReason("length", length=0))
                return True
        token = result.next_token_ids[i]
        self._append_token(req, token, result.logprobs[i], result.top_logprobs[i])
        self.stats.generated_tokens += 1
        reason = self._check_finish(req)
        if reason is not None:
            if req in self.running:
                self.running.remove(req)
            self._finish(req, reason)
        elif batch.mode == ForwardMode.EXTEND:
            self.kv.cache_unfinished(req)
            self.running.append(req)
        return True

    @staticmethod
    def _append_token(req: Req, token: int, logprob: float | None, top: list | None) -> None:
        """One generated token onto the request: its output, its grammar (a token the grammar
        refuses cannot come from a correct mask) and the logprobs it asked for."""
        req.output_ids.append(token)
        if req.grammar is not None and not req.grammar.accept(token):
            raise RuntimeError(f"token {token} does not continue the request's grammar")
        if req.return_logprob:
            req.output_logprobs.append(logprob)
        if req.top_logprobs_num:
            req.output_top_logprobs.append(top)

    def _take_verify(self, batch: ScheduleBatch, result: WorkerResult, i: int, req: Req) -> bool:
        """A speculative round: append the emitted tokens up to the first that finishes the
        request; keep the slots of the root and of the appended tokens but the last, free the
        rest."""
        req.draft_tokens = req.draft_parents = None
        emitted = result.emitted_ids[i]
        reason = None
        appended = 0
        for j, token in enumerate(emitted):
            logprob = result.emitted_logprobs[i][j] if req.return_logprob else None
            top = result.emitted_top_logprobs[i][j] if req.top_logprobs_num else None
            self._append_token(req, token, logprob, top)
            appended += 1
            reason = self._check_finish(req)
            if reason is not None:
                break
        slots, req.spec_slots = req.spec_slots, []
        if self.planner is not None and result.node_ranks:
            ranks = result.node_ranks[i]
            path = [ranks[node] for node in result.accepted_nodes[i][1:]]
            req.spec_expected_drafts += self.planner.observe(
                req.spec_kind, len(slots) - 1, path, result.draft_probs[i]
            )
        kept = [slots[node] for node in result.accepted_nodes[i][:appended]]
        req.kv_slots.extend(kept)
        kept_set = set(kept)
        self.kv.allocator.free([s for s in slots if s not in kept_set])
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += appended - 1
        self.stats.spec_verify_ct += 1
        self.stats.spec_emitted_tokens += appended
        self.stats.generated_tokens += appended
        if reason is not None:
            self.running.remove(req)
            self._finish(req, reason)
        return True

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
            if p.stop_regex:
                found = p.search_stop_regex(p.decode(self.tokenizer, req.output_ids))
                if found is not None:
                    req.stop_text_cut = found.start() if not p.no_stop_trim else None
                    return FinishReason("stop", matched=found.re.pattern)
        if len(req.output_ids) >= self.max_output(req):
            return FinishReason("length", length=len(req.output_ids))
        if req.grammar is not None and req.grammar.terminated:
            return FinishReason("stop", matched=token)  # the grammar's end (ignore_eos or not)
        return None

    def _match_stop_string(self, req: Req) -> FinishReason | None:
        p = req.sampling_params
        longest = max(len(s) for s in p.stop)
        tail_ids = req.output_ids[-(longest + 2) :]
        tail = p.decode(self.tokenizer, tail_ids)
        for stop in p.stop:
            if stop in tail:
                text = p.decode(self.tokenizer, req.output_ids)
                req.stop_text_cut = text.find(stop) if not p.no_stop_trim else None
                return FinishReason("stop", matched=stop)
        return None

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """Mark finished and release its KV (computed tokens go to the radix cache)."""
        req.finished_reason = reason
        req.finished_at = time.perf_counter()
        self.kv.release(req)
        if self.ngram is not None and reason.type != "abort":
            self.ngram.add_sequence(req.all_ids)
