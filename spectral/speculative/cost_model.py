"""What a speculative round costs on this worker: measured once at start-up (a few seconds) or
read from a per-machine cache, so that the tree planner can size trees by what forwards really
cost here.

Three measured curves, in milliseconds:
- `verify_ms(n)`: a round of one request whose tree has n nodes (root included) given to the
  worker: the target forward over the n tokens under the tree mask, verification, and the head
  extending over the accepted tokens. Rounds of several requests are costed by the nodes of all
  their trees together (a forward's cost follows its tokens: cost_curve.py measured batch- and
  verify-shaped forwards within noise of each other);
- `decode_ms(b)`: a plain decode step of b requests, `decode_ms(1)` measured and larger batches
  following the verify curve (`decode_ms(1) + verify_ms(b) - verify_ms(1)`);
- `draft_ms(b, levels)`: the head expanding a tree `levels` deep below each of b requests (the
  first level is the top-k the head kept after its last extend; each further one is a head
  forward over b x topk nodes).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spectral.cache import DEFAULT_CACHE_DIR
from spectral.forward import ForwardMode
from spectral.sampling_params import SamplingParams
from spectral.worker.io import RequestSampling, WorkerBatch

if TYPE_CHECKING:
    from spectral.worker.spec_worker import SpeculativeWorker

logger = logging.getLogger(__name__)

CACHE_DIR = DEFAULT_CACHE_DIR / "cost_models"
# Tree sizes (nodes, root included) and draft batch sizes measured at start-up.
VERIFY_POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DRAFT_POINTS = (1, 4)
PREFIX = 256  # tokens of context the measured requests hold (a chat prompt and its answer)
REPEATS = 3


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

    def verify_ms(self, nodes: int) -> float:
        return max(interpolate(self.verify, nodes), 0.0)

    def decode_ms(self, batch: int) -> float:
        return max(self.decode_one + self.verify_ms(batch) - self.verify_ms(1), 1e-3)

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
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                "a cost model is JSON with 'verify' ([[nodes, ms], ...] for one request's tree), "
                "'decode_one' (ms) and optionally 'draft' ([[requests, ms of one level, ms of "
                f"each further level], ...]): {err}"
            ) from err
        if not model.verify or model.verify[0][0] < 1 or model.decode_one <= 0:
            raise ValueError("a cost model needs verify points from 1 node up and decode_one > 0")
        return model

    def summary(self) -> dict:
        """A few points of each curve, for /get_server_info."""
        return {
            "verify_ms": {n: round(self.verify_ms(n), 2) for n in (1, 2, 4, 8, 16, 32)},
            "decode_ms": {b: round(self.decode_ms(b), 2) for b in (1, 4, 16)},
            "draft_ms_one_and_three_levels": {
                b: [round(self.draft_ms(b, 1), 2), round(self.draft_ms(b, 3), 2)]
                for b in (1, 4, 16)
            },
        }


def cache_key(parts: dict) -> str:
    """The cache file name for a worker described by `parts` (anything that changes costs:
    the machine, the model and its weight format, dtype, threads, the head and its tree)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def load_or_measure(worker: SpeculativeWorker, parts: dict, path: str | None = None) -> CostModel:
    """The cost model at `path` (given by hand), else the cached one for `parts`, else measured
    now and cached."""
    if path is not None:
        return CostModel.from_dict(json.loads(Path(path).read_text()))
    file = CACHE_DIR / f"{cache_key(parts)}.json"
    if file.exists():
        try:
            return CostModel.from_dict(json.loads(file.read_text()))
        except (ValueError, json.JSONDecodeError):
            logger.warning("ignoring a malformed cached cost model at %s", file)
    start = time.perf_counter()
    model = measure(worker)
    logger.info(
        "measured the speculative cost model in %.1f s (cached at %s): %s",
        time.perf_counter() - start,
        file,
        model.summary(),
    )
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps({**model.to_dict(), "parts": parts}))
    except OSError as err:
        logger.warning("could not cache the cost model (%s)", err)
    return model


def timed(fn, repeats: int = REPEATS, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `repeats` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _ms(fn) -> float:
    return 1000 * timed(fn)


@torch.inference_mode()
def measure(worker: SpeculativeWorker) -> CostModel:
    """Measure the curves on `worker` before it serves anyone: request row 0 and the slots
    from 1 up are used as scratch (nothing is allocated yet, and a request that later takes
    them rewrites what it reads)."""
    target = worker.target
    max_nodes = min(max(VERIFY_POINTS), target.num_kv_slots - PREFIX - 2)
    greedy = RequestSampling(SamplingParams(temperature=0.0, max_new_tokens=1))
    prefix_ids = [(7 * i + 3) % target.config.vocab_size for i in range(PREFIX)]
    slots = list(range(1, PREFIX + max_nodes + 1))

    def batch(mode: ForwardMode, ids: list[int], start: int, **extra) -> WorkerBatch:
        n = len(ids) if mode == ForwardMode.EXTEND else extra.pop("nodes", 1)
        return WorkerBatch(
            mode=mode,
            input_ids=ids,
            positions=list(range(start, start + len(ids))),
            out_cache_loc=slots[start : start + n],
            req_pool_indices=[0],
            prefix_lens=[start],
            extend_lens=[n],
            sampling=[greedy],
            **extra,
        )

    worker.forward(batch(ForwardMode.EXTEND, prefix_ids, 0))
    verify = []
    for n in (p for p in VERIFY_POINTS if p <= max_nodes):
        # A chain of n - 1 given draft tokens below the root: no head draft in it.
        tree = batch(
            ForwardMode.TARGET_VERIFY,
            [prefix_ids[-1]],
            PREFIX,
            nodes=n,
            draft_tokens=[[3] * (n - 1)],
            draft_parents=[list(range(n - 1))],
        )
        verify.append((n, _ms(lambda wb=tree: worker.forward(wb))))
    step = batch(ForwardMode.DECODE, [prefix_ids[-1]], PREFIX)
    decode_one = _ms(lambda: worker.forward(step))
    draft = [(1, 0.0, 0.0)]
    drafter = worker.drafter
    if drafter is not None:
        seq = torch.tensor([PREFIX])
        draft = []
        levels = max(drafter.num_steps, 2)
        for b in DRAFT_POINTS:
            rows = torch.zeros(b, dtype=torch.int64)
            first = _ms(lambda rows=rows: drafter.draft(rows, seq.expand(len(rows)), 1))
            deep = _ms(lambda rows=rows: drafter.draft(rows, seq.expand(len(rows)), levels))
            draft.append((b, first, max(deep - first, 0.0) / (levels - 1)))
    return CostModel(verify=verify, decode_one=decode_one, draft=draft)
