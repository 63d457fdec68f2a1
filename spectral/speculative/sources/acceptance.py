"""Acceptance by rank: what each rank of a drafter's tree is expected to add, learnt from
verified rounds per kind of tree (the head's by its confidence, the n-gram drafter's by the
length of its match). The tree planner reads it: docs/speculative.md, "Trees sized by what a
round costs"."""

from __future__ import annotations

import functools
import math

HEAD, NGRAM, REST = "head", "ngram", "rest"
# A datastore's trees count apart by the length matched, longer ones together.
REST_LONGEST_BUCKET = 8
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
# n-gram prior: the first node of a matched continuation, then each next one (optimistic: a
# rank is learnt only once verified); a head's too, until its scores are calibrated
NGRAM_FIRST, NGRAM_DECAY = 0.6, 0.85


def head_bucket(top1: float | None) -> str:
    """The statistics a head tree counts in, by the head's top-1 probability (None: unknown)."""
    if top1 is None:
        return f"{HEAD}:?"
    return f"{HEAD}:{sum(top1 >= t for t in HEAD_CONFIDENCE)}"


def ngram_bucket(match_len: int) -> str:
    """The statistics an n-gram tree counts in, by the length of the suffix it matched."""
    return f"{NGRAM}:{match_len}"


def ngram_reach_bucket(shortest: int, longest: int) -> str:
    """The best of the n-gram buckets `shortest`..`longest` (an upper bound on a tree whose match
    is not looked up: `TreePlanner` takes each rank's best gain among them)."""
    return f"{NGRAM}:{shortest}-{longest}"


@functools.lru_cache(maxsize=1024)
def reach_range(kind: str) -> tuple[int, int] | None:
    """(shortest, longest) of an `ngram_reach_bucket`, None for any other kind."""
    family_name, _, rest = kind.partition(":")
    if family_name != NGRAM or "-" not in rest:
        return None
    shortest, longest = rest.split("-")
    return int(shortest), int(longest)


def rest_bucket(match_len: int) -> str:
    """The statistics of a tree from the datastore alone, by the length of suffix it matched."""
    return f"{REST}:{min(match_len, REST_LONGEST_BUCKET)}"


@functools.lru_cache(maxsize=1024)
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
        self._gains: dict[int, list[float]] = {}  # `gains` by ranks, until the next round

    @staticmethod
    def _grow(values: list[float], size: int) -> None:
        values.extend([0.0] * (size - len(values)))

    def observe(self, verified: int, path_ranks: list[int], scores: list[float] | None) -> None:
        """One round: `verified` non-root nodes, the ranks of the accepted drafts in path order,
        and (head) the probabilities of the drafted candidates, best first."""
        self._gains.clear()
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
        """Expected accepted drafts each of the first `ranks` ranks adds, non-increasing (the
        caller must not change the list)."""
        found = self._gains.get(ranks)
        if found is None:
            found = self._gains[ranks] = self._compute_gains(ranks)
        return found

    def _compute_gains(self, ranks: int) -> list[float]:
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


def probabilities(logprobs: list[float]) -> list[float]:
    """Cumulative draft log-probabilities as probabilities, best first."""
    return sorted((math.exp(lp) for lp in logprobs if lp > -math.inf), reverse=True)


# A head tree's request whose top-k is known (FRESH) or stale (STALE: its last positions went by
# in plain steps or scheduler-drafted rounds; the head runs there before drafting).
FRESH, STALE = 1, 2


def head_kind(kind: str) -> int:
    """FRESH or STALE for a head tree's statistics (the head's top-k after the request's last
    token kept, or to be computed first), 0 for a scheduler's tree."""
    if family(kind) != HEAD:
        return 0
    return STALE if kind == head_bucket(None) else FRESH
