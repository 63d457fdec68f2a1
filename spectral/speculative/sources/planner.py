"""TreePlanner: how many tree nodes each running request verifies this round, and from which
source, or no round at all, so that the batch's expected tokens per second is highest under the
measured cost model. Acceptance is learnt per rank of the drafter's confidence
(`acceptance.RankStats`): docs/speculative.md, "Trees sized by what a round costs"."""

from __future__ import annotations

import itertools
import math

from spectral.core.forward import ForwardMode
from spectral.speculative.cost_model import BatchCalibration, CostCurves, CostModel
from spectral.speculative.sources import plan_record
from spectral.speculative.sources.acceptance import (
    HEAD,
    NGRAM_DECAY,
    NGRAM_FIRST,
    STALE,
    RankStats,
    family,
    head_kind,
    ngram_bucket,
    reach_range,
)
from spectral.speculative.sources.plan_record import HeadLedger, Plan, PlanInput, Record, min_gain

__all__ = ["Plan", "PlanInput", "TreePlanner"]

# The prior a request's record starts from: accepted drafts against the statistics' expectation
# over every request's rounds with trees of one family (head or n-gram), each round's weight
# decaying by this factor a request-round, behind this many pseudo-tokens at 1. Ranks the
# statistics have seen little of are expected at their (optimistic) prior; the requests before
# say by how much, so that a new request is not planned on it.
FAMILY_DECAY = 0.98
FAMILY_PRIOR = 10.0
# After this many plain steps in a row, a round the model expects to break even without the
# margin is run (a probe): calibrations that a few slow rounds spoilt are measured again rather
# than declining every round for good. Never where the model expects a round to lose.
PROBE_EVERY = 64
# A declined plan is declined again without planning while the batch's inputs and the
# statistics are unchanged and no calibration factor has moved by more than this (in log), or
# than the margin where it is smaller: planning a batch of one costs ~1% of a plain step on the
# default model. The last DECLINED_KEPT declined plans are kept (the n-gram buckets a request
# moves between).
DECLINED_TOLERANCE = 0.05
DECLINED_KEPT = 64
# A batch whose requests have at most this many combinations of sources has every combination
# planned (a few requests with two sources each); a larger one the best few.
EXHAUSTIVE_CHOICES = 8


class TreePlanner:
    def __init__(
        self,
        cost: CostModel,
        max_levels: int = 1 << 30,
        head_prior: tuple[float, float] | None = None,
        worker_drafter: bool = False,
    ) -> None:
        """`max_levels`: the deepest draft the head makes (its steps per round); `head_prior`:
        (first-rank acceptance, decay by rank) of the worker drafter's trees before any is
        verified (its registry entry's; None: the n-gram prior); `worker_drafter`: `min_gain`'s."""
        self.cost, self.max_levels, self.worker_drafter = cost, max_levels, worker_drafter
        self.head_prior = head_prior or (NGRAM_FIRST, NGRAM_DECAY)
        self.stats: dict[str, RankStats] = {}
        self.curves = CostCurves(cost)
        # measured against predicted: plain steps, rounds without drafting, rounds with it
        kinds = ("plain", "rounds", "drafted_rounds")
        self.calibration = {kind: BatchCalibration() for kind in kinds}
        self._scale = (1.0, 1.0, 1.0)  # this plan's factors, in that order
        self.record = Record()
        self.head_ledger = HeadLedger()
        self.shortfall = plan_record.Shortfall()
        self._emitted_seen = 0  # the record's emitted tokens at the last step timed
        self.last: dict = {}
        self._pending: Plan | None = None
        # per family: (accepted, expected) drafts over every request's rounds, decayed
        self._family: dict[str, tuple[float, float]] = {}
        self._margin: float | None = None  # in place of min_gain (`_best_plan_at`)
        self._declined = 0  # plans in a row without a round
        self._probing = False  # the last plan is a probe
        self._version = 0  # of the statistics: observe() moves it
        # declined plans by their inputs: (the calibration's log factors, the plan), while the
        # statistics stay at `_declined_version`
        self._declined_plans: dict[tuple, tuple[list[float], Plan]] = {}
        self._declined_version = 0

    def request_scale(self, req: PlanInput, kind: str) -> float:
        """The factor on the statistics' gains of request `req`'s tree of `kind`."""
        accepted, expected = self._family.get(family(kind), (0.0, 0.0))
        return req.scale((accepted + FAMILY_PRIOR) / (expected + FAMILY_PRIOR))

    def factors(self, batch: int) -> tuple[float, float, float]:
        """The calibration factors a plan for `batch` requests uses (plain steps, rounds,
        drafted rounds): each its bucket's, or the one before it where its kind has no step."""
        factor, out = 1.0, []
        for cal in self.calibration.values():
            own = cal.factor_for(batch)
            factor = factor if own is None else own
            out.append(factor)
        return tuple(out)

    def plan(self, reqs: list[PlanInput]) -> Plan:
        """The plan of the highest expected tokens per second (`best_plan`), or after
        PROBE_EVERY plans in a row without a round, one the model expects to break even."""
        self._probing = False
        best = self._best_or_declined(reqs)
        if best.speculate:
            self._declined = 0
            return best
        self._declined += 1
        if self._declined < PROBE_EVERY:
            return best
        self._declined = 0  # one probe tried in PROBE_EVERY plans, run or not
        probe = self._best_plan_at(reqs, 1.0)
        if not probe.speculate:
            return best
        self.record.probes += 1
        self._probing = True
        return probe

    def declines(self, reqs: list[PlanInput]) -> bool:
        """Whether the best plan for `reqs` is no round (no plan or probe counted: `reqs` bound
        what a step could plan, e.g. n-gram trees not looked up, `ngram_reach_bucket`)."""
        return not self._best_or_declined(reqs).speculate

    def _best_or_declined(self, reqs: list[PlanInput]) -> Plan:
        """`best_plan`, or a declined plan kept for the same inputs (at calibration factors and
        margin within DECLINED_TOLERANCE or the margin of today's, the statistics unchanged
        since, and catch-ups no smaller: a plan declined at a draft's catch-up is declined at a
        longer one)."""
        if self._declined_version != self._version:
            self._declined_plans.clear()
            self._declined_version = self._version
        key = tuple((r.kind, r.max_nodes, r.accepted, r.expected, r.others) for r in reqs)
        margin = self.margin(len(reqs))  # a factor too: the rounds' shortfall moves it
        factors = [math.log(f) for f in (*self.factors(len(reqs)), margin)]
        catch_ups = [r.catch_up_ms for r in reqs]
        last = self._declined_plans.get(key)
        tolerance = min(DECLINED_TOLERANCE, math.log(margin))
        if last is not None and all(abs(a - b) <= tolerance for a, b in zip(factors, last[0])):
            if all(c >= d for c, d in zip(catch_ups, last[2])):  # no cheaper to draft now
                return last[1]  # a declined plan: no one reads or changes its nodes
        best = self.best_plan(reqs)
        if best.speculate:
            self._declined_plans.pop(key, None)
        else:
            if len(self._declined_plans) >= DECLINED_KEPT:
                self._declined_plans.clear()
            self._declined_plans[key] = (factors, best, catch_ups)
        return best

    def replan(self, reqs: list[PlanInput]) -> Plan:
        """The last `plan` made again for the same requests with smaller trees (some came out
        smaller than the most nodes it was given), at that plan's margin."""
        self.record.replans += 1
        return self._best_plan_at(reqs, 1.0 if self._probing else self._margin)

    def margin(self, batch: int) -> float:
        """`min_gain` over the rounds' `Shortfall` for `batch` requests, or a probe's 1.0."""
        if self._margin is None:
            return min_gain(batch, self.worker_drafter) / self.shortfall.factor(batch)
        return self._margin

    def _best_plan_at(self, reqs: list[PlanInput], margin: float | None) -> Plan:
        """`best_plan` with `margin` in place of the usual one."""
        usual, self._margin = self._margin, margin
        try:
            return self.best_plan(reqs)
        finally:
            self._margin = usual

    def best_plan(self, reqs: list[PlanInput]) -> Plan:
        """The plan of the highest expected tokens per second. A request with several sources
        gets its tree from one: every choice is tried where there are at most
        `EXHAUSTIVE_CHOICES` of them, else each request's best by its own expected net gain,
        everyone's first source, and everyone's last."""
        B = len(reqs)
        self._scale = self.factors(B)
        most = max((n for req in reqs for _, n in req.options), default=1) - 1
        kinds = {kind for req in reqs for kind, _ in req.options}
        table = {kind: self._gains(kind, most) for kind in kinds}
        counts = [1 + len(req.others) for req in reqs]
        if all(c == 1 for c in counts):
            return self._plan_for(reqs, [0] * B, table)
        if math.prod(counts) <= EXHAUSTIVE_CHOICES:
            choices = list(itertools.product(*(range(c) for c in counts)))
        else:
            by_gain = self._by_net_gain(reqs, table, most)
            choices = [by_gain, (0,) * B, tuple(c - 1 for c in counts)]
        best: Plan | None = None
        for choice in dict.fromkeys(tuple(c) for c in choices):
            plan = self._plan_for(reqs, list(choice), table)
            if best is None or plan.beats(best):
                best = plan
        return best

    def _by_net_gain(
        self, reqs: list[PlanInput], table: dict[str, list[float]], most: int
    ) -> tuple:
        """Each request's source whose tree is expected to gain the most tokens net of what its
        nodes (and, for a drafter in the worker, its share of the drafting) cost, valued at a
        plain step's rate; `most`: the most non-root nodes any option has."""
        B = len(reqs)
        plain, rounds, drafted = self._scale
        rate = B / (self.curves.plain(B) * plain)
        if most < 1:
            return (0,) * B
        node_ms = (self.curves.verify(B * (1 + most)) - self.curves.verify(B)) / (B * most)
        # a request's share of drafting n nodes deep for everyone
        draft_share = [
            drafted * self.curves.draft(B, min(self.max_levels, n)) / B for n in range(most + 1)
        ]
        choice = []
        for req in reqs:
            values = []
            for kind, max_nodes in req.options:
                head = head_kind(kind)
                node_cost = rate * node_ms * (drafted if head else rounds)
                # a stale head's run at its last position, a draft model's catch-up: first node's
                refresh = self.curves.refresh(1) if head == STALE else 0.0
                net = -rate * drafted * (refresh + req.catch_up_ms) if head else 0.0
                best, scale = 0.0, self.request_scale(req, kind)
                for n, g in enumerate(table[kind][: max(max_nodes - 1, 0)], start=1):
                    net += min(1.0, g * scale) - node_cost
                    best = max(best, net - rate * draft_share[n] if head else net)
                values.append(best)
            choice.append(values.index(max(values)))
        return tuple(choice)

    def _plan_for(
        self, reqs: list[PlanInput], choice: list[int], table: dict[str, list[float]]
    ) -> Plan:
        """The best plan where request b's tree comes from its option `choice[b]`: nodes taken
        best gain first, for every cap on the head's trees (each level the head drafts costs
        the whole batch a step of it, so a deeper tree may pay only without the last few)."""
        B = len(reqs)
        plain_ms = self.curves.plain(B) * self._scale[0]
        plain = Plan([1] * B, False, float(B), plain_ms, plain_ms, choice)
        _, rounds, drafted = self._scale
        # a node gaining no more than this never pays for what it adds to a verify (`_greedy`)
        cutoff = self.margin(B) * plain.rate * min(rounds, drafted) * self.curves.least_slope(B)
        gains = []  # (-gain, rank, request, drafted by the head: FRESH or STALE, else 0)
        for b, (req, c) in enumerate(zip(reqs, choice)):
            kind, max_nodes = req.options[c]
            scale, head = self.request_scale(req, kind), head_kind(kind)
            for r, g in enumerate(table[kind][: max(max_nodes - 1, 0)]):
                g = min(1.0, g * scale)
                if g <= cutoff:
                    break  # a rank gains no more than the one before it
                gains.append((-g, r, b, head))
        gains.sort()
        deepest = max((r + 1 for _, r, _, head in gains if head), default=0)
        caps = range(1, min(deepest, self.max_levels) + 1) if deepest else [0]
        best, taken = plain, []
        for cap in caps:
            entries = [e for e in gains if not e[3] or e[1] < cap]
            plan, length = self._greedy(entries, plain_ms, choice, best, reqs)
            if length:
                best, taken = plan, entries[:length]
        if not best.speculate:
            self.last = {"batch": B, "speculate": False}
            return plain
        best.nodes = [1] * B
        for _, _, b, _ in taken:
            best.nodes[b] += 1
        return best

    def _greedy(
        self, entries: list, plain_ms: float, choice: list[int], best: Plan, reqs: list
    ) -> tuple[Plan, int]:
        """The best prefix of `entries` (best gain first), if it beats `best`: (its plan, its
        length); else (`best`, 0). The head's first node for request b adds its catch-up."""
        B, drafted = len(reqs), set()
        stale: set[int] = set()  # of those, the rows whose head runs at their last position first
        deepest = 0  # the most nodes any tree the head drafts has so far (root included)
        nodes = [1] * B
        expected = float(B)
        found, catch_up = None, 0.0  # (expected, ms, length) of the best prefix; catch-ups
        threshold = (1.0 if best.speculate else self.margin(B)) * best.rate
        _, rounds, drafted_rounds = self._scale
        least = min(rounds, drafted_rounds) * self.curves.least_slope(B)
        for length, (neg_gain, _, b, head) in enumerate(entries, start=1):
            gain = -neg_gain
            expected += gain
            nodes[b] += 1
            if head:
                catch_up += 0.0 if b in drafted else reqs[b].catch_up_ms
                drafted.add(b)
                if head == STALE:
                    stale.add(b)
                deepest = max(deepest, nodes[b])
            if gain <= threshold * least:
                break  # no later node (gaining no more) pays for what it adds to the verify
            verify_ms = self.curves.verify(B + length)
            # A tree of n nodes needs at most n - 1 levels of draft.
            draft_ms = self.curves.draft(len(drafted), min(self.max_levels, deepest - 1))
            draft_ms += self.curves.refresh(len(stale)) + catch_up
            ms = (drafted_rounds if drafted else rounds) * (verify_ms + draft_ms)
            if expected > threshold * ms:
                found = expected, ms, length, verify_ms, draft_ms
                threshold = expected / ms
        if found is None:
            return best, 0
        expected, ms, length, verify_ms, draft_ms = found
        return Plan([], True, expected, ms, plain_ms, choice, verify_ms, draft_ms), length

    def record_plan(self, plan: Plan, nodes: list[int]) -> None:
        """The round about to run: `plan`, with the tree sizes it got (the pool may cut them)."""
        self._pending = plan
        self.record.add_round(plan, nodes)
        self.last = {
            "batch": len(nodes),
            "speculate": True,
            "tree_nodes": nodes,
            "predicted_gain": round(plan.predicted_gain, 3),
        }

    def record_step(self, mode: ForwardMode, batch: int, seconds: float, awake=False) -> None:
        """How long a verify round or a plain decode step took (`awake`: the head kept ready)."""
        ms = 1000 * seconds
        if mode == ForwardMode.TARGET_VERIFY and self._pending is not None:
            emitted = self.record.emitted_tokens - self._emitted_seen  # by this round
            self._emitted_seen = self.record.emitted_tokens
            self.record.measured_ms += ms
            plan, self._pending = self._pending, None
            kind = "drafted_rounds" if plan.draft_ms > 0 else "rounds"
            # a kind's first round moves from the factor its plan was made with
            base = plan.verify_ms + plan.draft_ms
            start = plan.predicted_ms / base if base > 0 else 1.0
            self.calibration[kind].observe(ms, base, len(plan.nodes), start)
            self.shortfall.round(plan, emitted, ms)
            if plan.draft_ms > 0:  # the head drafted: its ledger, against plain steps without it
                B = len(plan.nodes)
                plain_step = self.curves.plain(B) * self.factors(B)[0] - self.cost.idle_ms(B)
                self.head_ledger.round(emitted, B, plain_step, ms)
        elif mode == ForwardMode.DECODE:
            if awake:
                self.head_ledger.plain_step(self.cost.idle_ms(batch))
            predicted = self.curves.plain(batch)
            record = self.record
            record.plain_steps += 1
            record.plain_measured_ms += ms
            # as the plans predict plain steps: calibrated
            plain = self.calibration["plain"]
            record.plain_predicted_ms += predicted * (plain.factor_for(batch) or 1.0)
            plain.observe(ms, predicted, batch)

    def observe(
        self, kind: str, verified: int, path_ranks: list[int], scores: list[float] | None
    ) -> float:
        """A request's verified round (`RankStats.observe`). Returns the accepted drafts the
        statistics expected of its `verified` nodes before this round."""
        stats = self.stats_for(kind)
        expected = sum(stats.gains(verified))
        stats.observe(verified, path_ranks, scores)
        self._version += 1
        accepted, before = self._family.get(family(kind), (0.0, 0.0))
        self._family[family(kind)] = (
            FAMILY_DECAY * accepted + len(path_ranks),
            FAMILY_DECAY * before + expected,
        )
        self.record.emitted_tokens += len(path_ranks) + 1
        return expected

    def _gains(self, kind: str, ranks: int) -> list[float]:
        """What each rank of a tree of `kind` is expected to add (`RankStats.gains`); of an
        `ngram_reach_bucket`, each rank's best among its buckets."""
        reach = reach_range(kind)
        if reach is None:
            return self.stats_for(kind).gains(ranks)
        buckets = [
            self.stats_for(ngram_bucket(n)).gains(ranks) for n in range(reach[0], reach[1] + 1)
        ]
        return [max(gains) for gains in zip(*buckets)]

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
            "head_value_ms": round(self.head_ledger.value, 1),
            "acceptance_over_expected": {
                name: round((a + FAMILY_PRIOR) / (e + FAMILY_PRIOR), 3)
                for name, (a, e) in sorted(self._family.items())
            },
            "calibration": {name: cal.to_dict() for name, cal in self.calibration.items()},
            "shortfall": self.shortfall.to_dict(),
        }
