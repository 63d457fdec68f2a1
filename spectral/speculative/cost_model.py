"""CostModel: what a speculative round costs on this worker, in milliseconds: `verify_ms(n)` a
round of n tree nodes, `decode_ms(b)` a plain step of b requests, `idle_ms(b)` what keeping
the drafter ready adds to that step, `draft_ms(b, levels)` the head's drafting
(docs/speculative.md, "Trees sized by what a round costs"). Measured at start-up by
`spectral.worker.cost_measure`; the tree planner reads it."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from dataclasses import dataclass, field

# Online calibration: a moving average of log(measured / predicted) over about
# 1 / CALIBRATION_RATE steps (its first steps weighed against CALIBRATION_PRIOR pseudo-steps
# at 1), each ratio bounded.
CALIBRATION_RATE = 0.05
CALIBRATION_PRIOR = 4
CALIBRATION_BOUNDS = (0.25, 4.0)


def interpolate(points: list[tuple[int, float]], x: float) -> float:
    """Piecewise-linear through `points` (sorted by x), extended linearly past either end."""
    xs = [p[0] for p in points]
    if len(points) == 1:
        return points[0][1]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    verify: list[tuple[int, float]]  # (tree nodes of one request, ms a round)
    decode_one: float  # ms of a plain decode step of one request
    # (requests, ms of a one-level draft, ms of each further level)
    draft: list[tuple[int, float, float]]
    # (requests, ms a plain step of that many costs the drafter: recording the step for its
    # next draft, its share of the queued work that recording defers)
    idle: list[tuple[int, float]] = field(default_factory=lambda: [(1, 0.0)])
    # ms a token of a request's context the drafter computes before it drafts for it again
    # (a draft model's catch-up over what was committed since it last did; 0: a head, whose
    # upkeep of each step is `idle`)
    catch_up: float = 0.0

    def verify_ms(self, nodes: int) -> float:
        return max(interpolate(self.verify, nodes), 0.0)

    def decode_ms(self, batch: int) -> float:
        return max(self.decode_one + self.verify_ms(batch) - self.verify_ms(1), 1e-3)

    def idle_ms(self, batch: int) -> float:
        return max(interpolate(self.idle, batch), 0.0)

    def plain_ms(self, batch: int) -> float:
        """A plain step of `batch` requests with the drafter kept ready: what declining costs."""
        return self.decode_ms(batch) + self.idle_ms(batch)

    def draft_ms(self, requests: int, levels: int) -> float:
        if not requests or levels < 1:
            return 0.0
        base = interpolate([(n, first) for n, first, _ in self.draft], requests)
        per_level = interpolate([(n, level) for n, _, level in self.draft], requests)
        return max(base, 0.0) + (levels - 1) * max(per_level, 0.0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """A cost model from its JSON form; raises ValueError on a malformed one."""
        try:
            model = cls(
                verify=sorted((int(n), float(ms)) for n, ms in data["verify"]),
                decode_one=float(data["decode_one"]),
                draft=sorted(
                    (int(n), float(first), float(level))
                    for n, first, level in data.get("draft", [[1, 0.0, 0.0]])
                ),
                idle=sorted((int(n), float(ms)) for n, ms in data.get("idle", [[1, 0.0]])),
                catch_up=float(data.get("catch_up", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                "a cost model is JSON with 'verify' ([[nodes, ms], ...] for one request's tree), "
                "'decode_one' (ms) and optionally 'draft' ([[requests, ms of one level, ms of "
                "each further level], ...]) and 'idle' ([[requests, ms the drafter adds to a "
                f"plain step], ...]): {err}"
            ) from err
        if not model.verify or model.verify[0][0] < 1 or model.decode_one <= 0:
            raise ValueError("a cost model needs verify points from 1 node up and decode_one > 0")
        if not model.idle or model.idle[0][0] < 1:
            raise ValueError("a cost model's idle points start from 1 request up")
        return model

    def summary(self) -> dict:
        """A few points of each curve, for /get_server_info (keyed by strings, as JSON is)."""
        return {
            "verify_ms": {str(n): round(self.verify_ms(n), 2) for n in (1, 2, 4, 8, 16, 32)},
            "decode_ms": {str(b): round(self.decode_ms(b), 2) for b in (1, 4, 16)},
            "idle_ms": {str(b): round(self.idle_ms(b), 3) for b in (1, 4, 16)},
            "catch_up_ms_per_token": round(self.catch_up, 4),
            "draft_ms_one_and_three_levels": {
                str(b): [round(self.draft_ms(b, 1), 2), round(self.draft_ms(b, 3), 2)]
                for b in (1, 4, 16)
            },
        }


class CostCurves:
    """A cost model's curves memoised for the tree planner (it asks the same points every
    step), with the least ms a node adds to a verify round from each measured point on."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._verify: dict[int, float] = {}
        self._draft: dict[tuple[int, int], float] = {}
        self._plain: dict[int, float] = {}
        # suffix minima of the verify curve's slopes, 0 where it is not increasing
        points = cost.verify
        slopes = [max(0.0, (y1 - y0) / (x1 - x0)) for (x0, y0), (x1, y1) in zip(points, points[1:])]
        self._slope_from = [p[0] for p in points[:-1]] or [points[0][0]]
        self._least_slopes = list(itertools.accumulate(reversed(slopes or [0.0]), min))[::-1]

    def verify(self, nodes: int) -> float:
        if nodes not in self._verify:
            self._verify[nodes] = self.cost.verify_ms(nodes)
        return self._verify[nodes]

    def plain(self, batch: int) -> float:
        found = self._plain.get(batch)
        if found is None:
            found = self._plain[batch] = self.cost.plain_ms(batch)
        return found

    def draft(self, requests: int, levels: int) -> float:
        if (requests, levels) not in self._draft:
            self._draft[requests, levels] = self.cost.draft_ms(requests, levels)
        return self._draft[requests, levels]

    def refresh(self, requests: int) -> float:
        """The head's run at the last position of `requests` whose top-k is stale, before it
        drafts: a forward of the head over one token each, as a further level of its draft."""
        return self.draft(requests, 2) - self.draft(requests, 1) if requests else 0.0

    def least_slope(self, nodes: int) -> float:
        """The least ms any node past the first `nodes` adds to a verify round."""
        i = max(bisect.bisect_right(self._slope_from, nodes) - 1, 0)
        return self._least_slopes[i]


class Calibration:
    """How far one kind of step's measured times are from what the cost model predicts, as a
    factor: a cost model measured on a busier (or quieter) machine, or cached from another
    day, is corrected by what the steps take now."""

    def __init__(self) -> None:
        self.log_factor = 0.0
        self.count = 0

    @property
    def factor(self) -> float:
        return math.exp(self.log_factor)

    def observe(self, measured_ms: float, predicted_ms: float, start: float = 1.0) -> None:
        """One step's times; `start`: the factor its first step moves from (the factor the
        plans used for this kind before any was timed)."""
        if predicted_ms <= 0:
            return
        lo, hi = CALIBRATION_BOUNDS
        ratio = min(hi, max(lo, measured_ms / predicted_ms))
        if not self.count:
            self.log_factor = math.log(start)
        self.count += 1
        rate = max(CALIBRATION_RATE, 1.0 / (self.count + CALIBRATION_PRIOR))
        self.log_factor += rate * (math.log(ratio) - self.log_factor)


class BatchCalibration:
    """Calibration of one kind of step per batch-size bucket (1, 2-3, 4-7, 8-15, ...): what a
    cost model measured on one request gets wrong grows with the batch (each request's own
    context, tree and sampling; rounds at batch 4 here took 1.8x the model while those at
    batch 1 took 1.2x), so one factor over every batch size follows whichever size ran last.
    A batch size's factor is its bucket's, else the nearest bucket's that has steps, else
    None (nothing timed). `factor` and `count` are over every batch size."""

    def __init__(self) -> None:
        self.overall = Calibration()
        self.buckets: dict[int, Calibration] = {}
        self._nearest: dict[int, Calibration] = {}  # by bucket, until a bucket is added

    @property
    def factor(self) -> float:
        return self.overall.factor

    @property
    def count(self) -> int:
        return self.overall.count

    def factor_for(self, batch: int) -> float | None:
        nearest = self._nearest_to(max(batch, 1).bit_length())
        return None if nearest is None else nearest.factor

    def _nearest_to(self, bucket: int) -> Calibration | None:
        found = self._nearest.get(bucket)
        if found is None and self.buckets:
            nearest = min(self.buckets, key=lambda b: (abs(b - bucket), b))
            found = self._nearest[bucket] = self.buckets[nearest]
        return found

    def observe(
        self, measured_ms: float, predicted_ms: float, batch: int = 1, start: float = 1.0
    ) -> None:
        """A step of `batch` requests; `start` as Calibration.observe's, for the first step
        over all sizes (a bucket's first starts from the nearest bucket's factor)."""
        key = max(batch, 1).bit_length()
        bucket = self.buckets.get(key)
        first = start  # a bucket's only matters to its first step
        if bucket is None:
            nearest = self._nearest_to(key)
            bucket = self.buckets[key] = Calibration()
            self._nearest.clear()
            first = start if nearest is None else nearest.factor
        bucket.observe(measured_ms, predicted_ms, first)
        self.overall.observe(measured_ms, predicted_ms, start)

    def to_dict(self) -> dict:
        return {
            "factor": round(self.factor, 3),
            "steps": self.count,
            "by_batch": {
                f"{1 << (b - 1)}-{(1 << b) - 1}": round(cal.factor, 3)
                for b, cal in sorted(self.buckets.items())
            },
        }
