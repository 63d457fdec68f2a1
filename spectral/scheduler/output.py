"""ResultIntake: a step's result onto its requests (tokens, logprobs, grammar state, the slots a
speculative round keeps) and the verdict for each: still running, or finished and why. The
scheduler moves requests between its queues by the verdict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spectral.core.forward import ForwardMode
from spectral.core.req import FinishReason, Req
from spectral.core.worker_io import WorkerResult
from spectral.scheduler.finish import FinishChecker
from spectral.scheduler.kv_manager import KVManager
from spectral.scheduler.schedule_batch import ScheduleBatch
from spectral.speculative.sources.round import SpecRound


@dataclass
class SchedulerStats:
    prefill_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens taken from the radix cache
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_steps_ahead: int = 0  # launched before the previous step's tokens were in
    retractions: int = 0
    spec_verify_ct: int = 0  # speculative rounds, summed over requests
    spec_emitted_tokens: int = 0  # tokens those rounds produced (accepted drafts + 1 each)

    @property
    def spec_accept_length(self) -> float:
        """Average tokens per speculative round and request (SGLang's accept length)."""
        return self.spec_emitted_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0

    def to_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "spec_accept_length": self.spec_accept_length}


@dataclass
class Verdict:
    changed: bool  # its output changed (a prompt chunk's does not)
    finished: FinishReason | None = None


class ResultIntake:
    def __init__(
        self,
        finish: FinishChecker,
        kv: KVManager,
        stats: SchedulerStats,
        spec_round: SpecRound | None,
    ) -> None:
        self.finish = finish
        self.kv = kv
        self.stats = stats
        self.spec_round = spec_round

    def take(self, batch: ScheduleBatch, result: WorkerResult, i: int, req: Req) -> Verdict:
        """Request `req`'s part (row `i`) of `batch`'s result."""
        req.spec.draft_top1 = result.draft_top1[i] if result.draft_top1 else None
        if batch.mode == ForwardMode.TARGET_VERIFY:
            return self._take_round(result, i, req)
        if batch.prefills(req):
            self.stats.prefill_tokens += req.extend_len
            if req.wants_input_logprobs:
                if not req.input_logprobs:
                    req.input_logprobs.append(None)  # the first scored token has no context
                if result.input_logprobs:
                    req.input_logprobs.extend(result.input_logprobs[i])
            if not batch.completes_prefill(req):
                return Verdict(changed=False)  # a chunk: its sampled token is meaningless
            if self.finish.max_output(req) == 0:  # prefilled only: cached, or scored
                return Verdict(True, FinishReason("length", length=0))
        append_token(req, result.next_token_ids[i], result.logprobs[i], result.top_logprobs[i])
        self.stats.generated_tokens += 1
        return Verdict(True, self.finish.check(req))

    def _take_round(self, result: WorkerResult, i: int, req: Req) -> Verdict:
        """A speculative round: append the emitted tokens up to the first that finishes the
        request; the request keeps the slots of the root and of the appended tokens but the
        last, the rest are freed."""
        reason = None
        appended = 0
        for j, token in enumerate(result.emitted_ids[i]):
            logprob = result.emitted_logprobs[i][j] if req.return_logprob else None
            top = result.emitted_top_logprobs[i][j] if req.top_logprobs_num else None
            append_token(req, token, logprob, top)
            appended += 1
            reason = self.finish.check(req)
            if reason is not None:
                break
        slots, req.spec.slots = req.spec.slots, []
        self.spec_round.observe(req, result, i, len(slots) - 1)
        kept = [slots[node] for node in result.accepted_nodes[i][:appended]]
        req.kv_slots.extend(kept)
        kept_set = set(kept)
        self.kv.give_back(req, [s for s in slots if s not in kept_set])
        req.spec.verify_ct += 1
        req.spec.accepted_tokens += appended - 1
        self.stats.spec_verify_ct += 1
        self.stats.spec_emitted_tokens += appended
        self.stats.generated_tokens += appended
        return Verdict(True, reason)


def append_token(req: Req, token: int, logprob: float | None, top: list | None) -> None:
    """One generated token onto the request: its output, its grammar (a token the grammar
    refuses cannot come from a correct mask) and the logprobs it asked for."""
    req.output_ids.append(token)
    if req.grammar is not None and not req.grammar.accept(token):
        raise RuntimeError(f"token {token} does not continue the request's grammar")
    if req.return_logprob:
        req.output_logprobs.append(logprob)
    if req.top_logprobs_num:
        req.output_top_logprobs.append(top)
