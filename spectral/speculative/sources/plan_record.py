"""The tree planner's inputs and plans (`PlanInput`, `Plan`), and its `Record`: what its plans
predicted and what its rounds and plain steps took, summed (/get_server_info's speculative
"rounds")."""

from __future__ import annotations

from dataclasses import dataclass, field

# A round must be expected to beat a plain step by this factor: a margin for the model's error,
# so that a busy server does not speculate for a gain it may not get. A batch of one without a
# drafter in the worker keeps ONE_REQUEST_MARGIN of it (1.02): its rounds' gains are predicted
# within 2-3% (HumanEval: 1.73 predicted, 1.70 measured), and at 1.05 the rounds it declined
# would have paid (the default model's HumanEval at batch 1, one sitting: NGRAM 1.14x at 1.05,
# 1.30x at 1.02; code edits 1.51x and 1.57x). With a head beside, more rounds kept it from what
# pays (every source on MT-Bench 0.94x at 1.02; docs/benchmarks.md); at batch 16 the model
# overpredicts by up to 10%.
MIN_GAIN = 1.05
ONE_REQUEST_MARGIN = 0.4


def min_gain(batch: int, worker_drafter: bool = False) -> float:
    """The gain over a plain step a round for `batch` requests must be expected to beat
    (`worker_drafter`: a drafter in the worker, an EAGLE head or a draft model, is kept)."""
    if batch > 1 or worker_drafter:
        return MIN_GAIN
    return 1.0 + (MIN_GAIN - 1.0) * ONE_REQUEST_MARGIN


# Where rounds of several requests fell short of what their plans predicted, the planner asks
# that much more of the next (`Shortfall`): MT-Bench at batch 4, NGRAM's rounds were predicted at
# 1.03x a plain step and measured 0.88x (the acceptance and the time each calibrated apart, each
# a little late, and the rounds run those whose predictions erred high). Per batch-size bucket,
# decayed by SHORTFALL_DECAY a round, behind SHORTFALL_PRIOR rounds that met their predictions;
# the margin grows by at most 1 / SHORTFALL_FLOOR and never shrinks. Not at batch 1, whose rounds
# are predicted within 2-3% and where 3% more margin cost HumanEval a tenth of its gain.
SHORTFALL_DECAY = 0.95
SHORTFALL_PRIOR = 4.0
SHORTFALL_FLOOR = 0.85


@dataclass
class Shortfall:
    """Measured against predicted gains of the rounds of each batch-size bucket (2-3, 4-7, ...)."""

    sums: dict[int, tuple[float, float]] = field(default_factory=dict)

    def round(self, plan: Plan, emitted: int, ms: float) -> None:
        """A round of `plan` emitted `emitted` tokens in `ms`."""
        batch = len(plan.nodes)
        if batch <= 1 or ms <= 0:
            return
        measured, predicted = self.sums.get(batch.bit_length(), (0.0, 0.0))
        self.sums[batch.bit_length()] = (
            SHORTFALL_DECAY * measured + plan.gain(emitted, ms),
            SHORTFALL_DECAY * predicted + plan.predicted_gain,
        )

    def factor(self, batch: int) -> float:
        """What the rounds of `batch` requests gave of their predictions (at most 1)."""
        if batch <= 1:
            return 1.0
        measured, predicted = self.sums.get(batch.bit_length(), (0.0, 0.0))
        ratio = (measured + SHORTFALL_PRIOR) / (predicted + SHORTFALL_PRIOR)
        return min(1.0, max(SHORTFALL_FLOOR, ratio))

    def to_dict(self) -> dict:
        return {
            f"{1 << (b - 1)}-{(1 << b) - 1}": round(self.factor(1 << (b - 1)), 3)
            for b in sorted(self.sums)
        }


# A request's own record: pseudo-tokens behind its scale factor, and the factor's bounds (a
# strong prior: a few lucky rounds must not buy a request large trees).
REQUEST_PRIOR = 10.0
REQUEST_SCALE = (0.5, 2.0)


@dataclass
class PlanInput:
    """One running request: which drafter would give its tree, the most nodes it can have
    (root included: what the settings, its context and an n-gram proposal allow), and its own
    acceptance record (accepted drafts and what its rounds' plans expected). `others`: the
    (kind, max_nodes) of other sources that could give its tree instead; the plan picks one."""

    kind: str  # HEAD or NGRAM, or a bucket of one
    max_nodes: int
    accepted: float = 0.0
    expected: float = 0.0
    others: tuple[tuple[str, int], ...] = ()
    catch_up_ms: float = 0.0  # what the worker's drafter computes before it drafts its tree

    @property
    def options(self) -> list[tuple[str, int]]:
        return [(self.kind, self.max_nodes), *self.others]

    def scale(self, prior: float = 1.0) -> float:
        """Its accepted drafts over what the statistics expected of its rounds, behind
        REQUEST_PRIOR pseudo-tokens at `prior` (what every request's rounds gave)."""
        lo, hi = REQUEST_SCALE
        ratio = (self.accepted + REQUEST_PRIOR * prior) / (self.expected + REQUEST_PRIOR)
        return min(hi, max(lo, ratio))


@dataclass
class Plan:
    nodes: list[int]  # per request, root included; all 1 and `speculate` False: decode plainly
    speculate: bool
    expected_tokens: float  # per round (or step), the whole batch
    predicted_ms: float
    plain_ms: float
    sources: list[int] | None = None  # per request, its option giving the tree (0: `kind`)
    # the cost model's verify and draft parts of `predicted_ms`, before calibration
    verify_ms: float = 0.0
    draft_ms: float = 0.0

    @property
    def rate(self) -> float:
        """Expected tokens per ms."""
        return self.expected_tokens / self.predicted_ms

    def beats(self, best: Plan) -> bool:
        """It speculates and `best` does not, or both do and it is faster."""
        if self.speculate != best.speculate:
            return self.speculate
        return self.speculate and self.rate > best.rate

    @property
    def predicted_gain(self) -> float:
        """Expected tokens/s of the plan over a plain step's."""
        return self.gain(self.expected_tokens, self.predicted_ms)

    def gain(self, tokens: float, ms: float) -> float:
        """`tokens` in `ms` over what plain steps of the plan's batch give (1.0 unknown)."""
        if ms <= 0 or self.plain_ms <= 0:
            return 1.0
        return (tokens / ms) / (len(self.nodes) / self.plain_ms)


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
    plain_ms: float = 0.0  # plain steps of the same batches, as predicted
    plain_steps: int = 0  # plain decode steps while speculation was on
    plain_predicted_ms: float = 0.0
    plain_measured_ms: float = 0.0
    probes: int = 0  # rounds run at no margin after PROBE_EVERY plain steps
    replans: int = 0  # plans made again where an n-gram tree came out smaller than planned

    def add_round(self, plan: Plan, nodes: list[int]) -> None:
        """A round about to run: `plan`, with the tree sizes it got."""
        self.rounds += 1
        self.requests += len(nodes)
        self.verified_nodes += sum(nodes)
        self.predicted_tokens += plan.expected_tokens
        self.predicted_ms += plan.predicted_ms
        self.plain_ms += plan.plain_ms

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


# The head's ledger decays by this factor an entry (its rounds and the plain steps while it is
# awake), and judges it after this many of its rounds.
HEAD_VALUE_DECAY = 0.99
HEAD_VALUE_ROUNDS = 8


@dataclass
class HeadLedger:
    """What keeping a worker drafter (an EAGLE head) awake has been worth, in ms, decayed by
    HEAD_VALUE_DECAY an entry: each round it drafted adds the time plain steps would have taken
    for the tokens the round emitted less the round's time; each plain step while it is awake
    takes off what keeping it ready cost that step (the cost model's `idle_ms`)."""

    value: float = 0.0
    rounds: int = 0

    def round(self, emitted: int, batch: int, plain_step_ms: float, ms: float) -> None:
        self.value = HEAD_VALUE_DECAY * self.value + emitted / batch * plain_step_ms - ms
        self.rounds += 1

    def plain_step(self, upkeep_ms: float) -> None:
        self.value = HEAD_VALUE_DECAY * self.value - upkeep_ms

    @property
    def in_the_red(self) -> bool:
        """Its rounds so far have cost more than they gave (judged or not yet)."""
        return self.value < 0

    @property
    def losing(self) -> bool:
        """Its rounds, HEAD_VALUE_ROUNDS or more of them, have not paid for its upkeep."""
        return self.rounds >= HEAD_VALUE_ROUNDS and self.in_the_red

    def reset(self) -> None:
        self.value, self.rounds = 0.0, 0


# After this many plans in a row declined no round, the next plans come a plain step apart, and
# one more step apart after each further PLAN_BACKOFF_AFTER declined, up to PLAN_BACKOFF_MOST
# steps: where no source has paid for a while (chat at batches 4 and 16) the lookups and
# planning, 1.5-2.5% of a plain step, cost a few tenths of that, and a source that starts to
# pay is planned again within that many steps. A request joining is planned for at once, its
# lookups may pay from its first step, and the count of declines keeps the share of it that the
# requests still running saw: a batch of one that a new request replaces plans every step
# again, while at batch 16 a join keeps 15/16 of it and the plans stay as far apart (a join that
# planned every step again kept two plans in three there, ~1% of a step on HumanEval).
PLAN_BACKOFF_AFTER = 16
PLAN_BACKOFF_MOST = 8
# A plain step that no plan came before (the head idle with no other source, the backoff's
# steps between plans, a batch over the speculative limit) is timed for the planner's
# calibration one in UNPLANNED_TIMED: its bookkeeping, cheap warm, runs with the caches cold
# from the forward (~25 us on the default model's ~4.8 ms step here, where 3.7 us warm); a
# planned step is always timed.
UNPLANNED_TIMED = 8


@dataclass
class PlanBackoff:
    """Which steps a SpecRound plans: every one, until PLAN_BACKOFF_AFTER plans in a row have
    declined; then one in a few (see above), until a plan runs a round; and the step a request
    joins. And which steps the planner times (UNPLANNED_TIMED)."""

    declined: int = 0  # plans in a row without a round
    skip: int = 0  # plain steps left before the next plan
    batch: frozenset = frozenset()  # the running requests' ids at the last step
    planned_step: bool = False  # a plan came before the step running now
    unplanned: int = 0  # plain steps without one

    def plans(self, rids: list[str]) -> bool:
        """Whether this step is planned (else it is a plain step, counted)."""
        running = frozenset(rids)
        joined = len(running - self.batch)
        self.batch = running
        if joined:  # its lookups may pay at once: planned, the others' share of declines kept
            self.declined = self.declined * (len(running) - joined) // len(running)
            self.skip = 0
            return True
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def restart(self) -> None:
        """Plan every step again, as if no plan had declined."""
        self.declined = self.skip = 0

    def timed(self, plain: bool) -> bool:
        """Whether the step just run is timed for the planner (`plain`: a plain decode step):
        every planned one or round, one in UNPLANNED_TIMED of the others."""
        planned, self.planned_step = self.planned_step, False
        if planned or not plain:
            return True
        self.unplanned += 1
        return self.unplanned % UNPLANNED_TIMED == 0

    def planned(self, speculate: bool) -> None:
        """The step's plan ran a round or declined one."""
        self.planned_step = True
        if speculate:
            self.restart()
        else:
            self.declined += 1
            self.skip = min(PLAN_BACKOFF_MOST, self.declined // PLAN_BACKOFF_AFTER)
