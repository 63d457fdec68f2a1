"""TreePlanner: how many tree nodes each running request verifies this round, or no round at
all, so that the batch's expected tokens per second is highest under the measured cost model.
Acceptance is learnt per rank of the drafter's confidence: docs/speculative.md, "Trees sized
by what a round costs"."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spectral.core.forward import ForwardMode
from spectral.speculative.cost_model import CostModel

HEAD, NGRAM = "head", "ngram"
# The head's confidence before it drafts (its top-1 probability after the last verified token)
# splits its statistics: rounds starting from a confident head are accepted far more often.
HEAD_CONFIDENCE = (0.3, 0.6, 0.85)
# Pseudo-rounds of the prior behind each rank's measured acceptance.
PRIOR_WEIGHT = 8.0
# Pseudo-tokens behind the head's scores being calibrated (accepted = predicted) before its
# record says how far they are.
SCORE_PRIOR = 10.0
# Pseudo-rounds of the decay prior behind a rank's mean drafted probability: a rank drafted in
# a round or two (a drafter drafts only the levels a plan needs) must not set its gain alone.
SCORE_SAMPLES_PRIOR = 4.0
# A request's own record: pseudo-tokens behind its scale factor, and the factor's bounds (a
# strong prior: a few lucky rounds must not buy a request large trees).
REQUEST_PRIOR = 10.0
REQUEST_SCALE = (0.5, 2.0)
# n-gram prior: the first node of a matched continuation, then each next one (optimistic: a
# rank is learnt only once verified); a head's too, until its scores are calibrated
NGRAM_FIRST, NGRAM_DECAY = 0.6, 0.85
# A draft model's prior: a small LM of the target's family agrees with it on most tokens (with
# the head's prior, a draft costing a fair share of a target step would never be tried, and
# so never measured).
DRAFT_MODEL_FIRST, DRAFT_MODEL_DECAY = 0.8, 0.9
# A round must be expected to beat a plain step by this factor: a margin for the model's error,
# so that a busy server does not speculate for a gain it may not get.
MIN_GAIN = 1.05


def head_bucket(top1: float | None) -> str:
    """The statistics a head tree counts in, by the head's top-1 probability (None: unknown)."""
    if top1 is None:
        return f"{HEAD}:?"
    return f"{HEAD}:{sum(top1 >= t for t in HEAD_CONFIDENCE)}"


def ngram_bucket(match_len: int) -> str:
    """The statistics an n-gram tree counts in, by the length of the suffix it matched."""
    return f"{NGRAM}:{match_len}"


def family(kind: str) -> str:
    """HEAD or NGRAM, for a bucket name (or a family name)."""
    return kind.split(":", 1)[0]


class RankStats:
    """Acceptance by rank for one kind of tree: the head's or the n-gram drafter's, or one
    bucket of them (`head_bucket`, `ngram_bucket`)."""

    def __init__(self, kind: str, prior: tuple[float, float] = (NGRAM_FIRST, NGRAM_DECAY)) -> None:
        """`prior`: the first rank's expected gain and its decay rank after rank, until the
        record (or, for a head, its calibrated scores) says otherwise."""
        self.kind = family(kind)
        self.prior = prior
        self.hits: list[float] = []  # rounds whose path's running highest rank was r
        self.seen: list[float] = []  # rounds that verified rank r
        self.score_sum: list[float] = []  # head: sum of the drafted rank-r probability
        self.score_n: list[float] = []
        self.predicted = 0.0  # head: sum of those probabilities over verified ranks
        self.accepted = 0.0  # and the accepted drafts there

    @staticmethod
    def _grow(values: list[float], size: int) -> None:
        values.extend([0.0] * (size - len(values)))

    def observe(self, verified: int, path_ranks: list[int], scores: list[float] | None) -> None:
        """One round: `verified` non-root nodes, the ranks of the accepted drafts in path order,
        and (head) the probabilities of the drafted candidates, best first."""
        for values in (self.hits, self.seen):
            self._grow(values, verified)
        for r in range(verified):
            self.seen[r] += 1
        highest = -1
        for rank in path_ranks:
            highest = max(highest, rank)
            self.hits[highest] += 1
        if scores:
            for values in (self.score_sum, self.score_n):
                self._grow(values, len(scores))
            for r, p in enumerate(scores):
                self.score_sum[r] += p
                self.score_n[r] += 1
            self.predicted += sum(scores[:verified])
            self.accepted += len(path_ranks)

    def gains(self, ranks: int) -> list[float]:
        """Expected accepted drafts each of the first `ranks` ranks adds, non-increasing."""
        out: list[float] = []
        scale = (self.accepted + SCORE_PRIOR) / (self.predicted + SCORE_PRIOR)
        for r in range(ranks):
            prior = self._prior(r, out, scale)
            seen = self.seen[r] if r < len(self.seen) else 0.0
            hits = self.hits[r] if r < len(self.hits) else 0.0
            gain = (hits + PRIOR_WEIGHT * prior) / (seen + PRIOR_WEIGHT)
            out.append(min(gain, out[-1]) if out else min(gain, 1.0))
        return out

    def _prior(self, r: int, before: list[float], scale: float) -> float:
        first, decay = self.prior
        fallback = before[-1] * decay if before else first
        if self.kind == HEAD and r < len(self.score_n) and self.score_n[r] > 0:
            n = self.score_n[r]
            scored = min(1.0, scale * self.score_sum[r] / n)
            return (n * scored + SCORE_SAMPLES_PRIOR * fallback) / (n + SCORE_SAMPLES_PRIOR)
        return fallback

    def to_dict(self, ranks: int = 8) -> dict:
        return {
            "rounds": int(self.seen[0]) if self.seen else 0,
            "gain_by_rank": [round(g, 3) for g in self.gains(ranks)],
        }


@dataclass
class PlanInput:
    """One running request: which drafter would give its tree, the most nodes it can have
    (root included: what the settings, its context and an n-gram proposal allow), and its own
    acceptance record (accepted drafts and what its rounds' plans expected)."""

    kind: str  # HEAD or NGRAM, or a bucket of one
    max_nodes: int
    accepted: float = 0.0
    expected: float = 0.0

    @property
    def scale(self) -> float:
        lo, hi = REQUEST_SCALE
        return min(hi, max(lo, (self.accepted + REQUEST_PRIOR) / (self.expected + REQUEST_PRIOR)))


@dataclass
class Plan:
    nodes: list[int]  # per request, root included; all 1 and `speculate` False: decode plainly
    speculate: bool
    expected_tokens: float  # per round (or step), the whole batch
    predicted_ms: float
    plain_ms: float

    @property
    def predicted_gain(self) -> float:
        """Expected tokens/s of the plan over a plain step's."""
        plain = len(self.nodes) / self.plain_ms
        return (self.expected_tokens / self.predicted_ms) / plain if self.predicted_ms else 1.0


@dataclass
class Record:
    """What the plans predicted and what the rounds and plain steps took, summed."""

    rounds: int = 0
    requests: int = 0  # requests in those rounds, summed
    verified_nodes: int = 0  # tree nodes verified (roots included)
    predicted_tokens: float = 0.0
    emitted_tokens: int = 0
    predicted_ms: float = 0.0
    measured_ms: float = 0.0
    plain_ms: float = 0.0  # the cost model's plain steps for the same batches
    plain_steps: int = 0  # plain decode steps while speculation was on
    plain_predicted_ms: float = 0.0
    plain_measured_ms: float = 0.0

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        if self.rounds:
            plain_rate = self.requests / self.plain_ms
            out["predicted_gain"] = self.predicted_tokens / self.predicted_ms / plain_rate
            # Measured rounds against plain steps as measured, where there were any.
            calibration = (
                self.plain_measured_ms / self.plain_predicted_ms if self.plain_steps else 1.0
            )
            out["measured_gain"] = (
                self.emitted_tokens / self.measured_ms / (plain_rate / calibration)
            )
            out["tree_nodes_per_request"] = self.verified_nodes / self.requests
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


class TreePlanner:
    def __init__(
        self, cost: CostModel, max_levels: int = 1 << 30, draft_model: bool = False
    ) -> None:
        """`max_levels`: the deepest draft the head makes (its steps per round); `draft_model`:
        the worker's drafter is a draft LM (STANDALONE), with a prior of its own."""
        self.cost = cost
        self.max_levels = max_levels
        self.head_prior = (
            (DRAFT_MODEL_FIRST, DRAFT_MODEL_DECAY) if draft_model else (NGRAM_FIRST, NGRAM_DECAY)
        )
        self.stats: dict[str, RankStats] = {}
        self._verify_ms: dict[int, float] = {}  # the cost model's curves, memoised
        self._draft_ms: dict[tuple[int, int], float] = {}
        self.record = Record()
        self.last: dict = {}
        self._pending: Plan | None = None

    def plan(self, reqs: list[PlanInput]) -> Plan:
        B = len(reqs)
        plain_ms = self.cost.decode_ms(B)
        plain = Plan([1] * B, False, float(B), plain_ms, plain_ms)
        most = max((req.max_nodes for req in reqs), default=1) - 1
        by_kind = {kind: self.stats_for(kind).gains(most) for kind in {r.kind for r in reqs}}
        gains = []
        for b, req in enumerate(reqs):
            scale = req.scale
            for r, g in enumerate(by_kind[req.kind][: max(req.max_nodes - 1, 0)]):
                gains.append((min(1.0, g * scale), b, r))
        gains.sort(key=lambda t: (-t[0], t[2], t[1]))
        best, best_len = plain, 0
        drafted: set[int] = set()
        deepest = 0  # the most nodes any tree the head drafts has so far (root included)
        nodes = [1] * B
        expected = float(B)
        for length, (gain, b, _) in enumerate(gains, start=1):
            if gain <= 0:
                break
            expected += gain
            nodes[b] += 1
            if family(reqs[b].kind) == HEAD:
                drafted.add(b)
                deepest = max(deepest, nodes[b])
            # A tree of n nodes needs at most n - 1 levels of draft.
            levels = min(self.max_levels, deepest - 1)
            ms = self._round_ms(B + length, len(drafted), levels)
            margin = 1.0 if best.speculate else MIN_GAIN
            if expected / ms > margin * best.expected_tokens / best.predicted_ms:
                best = Plan([], True, expected, ms, plain_ms)
                best_len = length
        if not best.speculate:
            self.last = {"batch": B, "speculate": False}
            return plain
        best.nodes = [1] * B
        for _, b, _ in gains[:best_len]:
            best.nodes[b] += 1
        return best

    def _round_ms(self, nodes: int, drafted: int, levels: int) -> float:
        if nodes not in self._verify_ms:
            self._verify_ms[nodes] = self.cost.verify_ms(nodes)
        if (drafted, levels) not in self._draft_ms:
            self._draft_ms[drafted, levels] = self.cost.draft_ms(drafted, levels)
        return self._verify_ms[nodes] + self._draft_ms[drafted, levels]

    def record_plan(self, plan: Plan, nodes: list[int]) -> None:
        """The round about to run: `plan`, with the tree sizes it got (the pool may cut them)."""
        self._pending = plan
        self.record.rounds += 1
        self.record.requests += len(nodes)
        self.record.verified_nodes += sum(nodes)
        self.record.predicted_tokens += plan.expected_tokens
        self.record.predicted_ms += plan.predicted_ms
        self.record.plain_ms += plan.plain_ms
        self.last = {
            "batch": len(nodes),
            "speculate": True,
            "tree_nodes": nodes,
            "predicted_gain": round(plan.predicted_gain, 3),
        }

    def record_step(self, mode: ForwardMode, batch: int, seconds: float) -> None:
        """How long a verify round or a plain decode step took."""
        if mode == ForwardMode.TARGET_VERIFY and self._pending is not None:
            self.record.measured_ms += 1000 * seconds
            self._pending = None
        elif mode == ForwardMode.DECODE:
            self.record.plain_steps += 1
            self.record.plain_measured_ms += 1000 * seconds
            self.record.plain_predicted_ms += self.cost.decode_ms(batch)

    def observe(
        self, kind: str, verified: int, path_ranks: list[int], scores: list[float] | None
    ) -> float:
        """A request's verified round (`RankStats.observe`). Returns the accepted drafts the
        statistics expected of its `verified` nodes before this round."""
        stats = self.stats_for(kind)
        expected = sum(stats.gains(verified))
        stats.observe(verified, path_ranks, scores)
        self.record.emitted_tokens += len(path_ranks) + 1
        return expected

    def stats_for(self, kind: str) -> RankStats:
        if kind not in self.stats:
            head = family(kind) == HEAD
            self.stats[kind] = RankStats(kind, self.head_prior) if head else RankStats(kind)
        return self.stats[kind]

    def to_dict(self) -> dict:
        return {
            "cost_model": self.cost.summary(),
            "acceptance": {kind: self.stats[kind].to_dict() for kind in sorted(self.stats)},
            "rounds": self.record.to_dict(),
            "last": self.last,
        }


def probabilities(logprobs: list[float]) -> list[float]:
    """Cumulative draft log-probabilities as probabilities, best first."""
    return sorted((math.exp(lp) for lp in logprobs if lp > -math.inf), reverse=True)
