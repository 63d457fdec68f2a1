"""Measure a speculative worker's CostModel at start-up (a few seconds), or read it from a
per-machine cache keyed by everything that changes what forwards cost."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from spectral.cache import DEFAULT_CACHE_DIR
from spectral.core.forward import ForwardMode
from spectral.core.worker_io import RequestSampling, WorkerBatch
from spectral.layers.parallel import TensorParallel
from spectral.sampling_params import SamplingParams
from spectral.speculative.cost_model import CostModel
from spectral.worker.spec_worker import SpeculativeWorker

logger = logging.getLogger(__name__)

CACHE_DIR = DEFAULT_CACHE_DIR / "cost_models"
# Tree sizes (nodes, root included) and draft batch sizes measured at start-up.
VERIFY_POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DRAFT_POINTS = (1, 4)
PREFIX = 256  # tokens of context the measured requests hold (a chat prompt and its answer)
REPEATS = 3
PASSES = 5  # of the verify curve and the plain step, interleaved
# Plain steps recorded by the drafter to time its upkeep (`idle`), the work it queues for them
# (a head's KV, run in batches of up to 256 tokens) written at their end and in the mean.
IDLE_STEPS = 64
# What the measurements mean: bumped when a change in the code makes cached models wrong (2: a
# round whose trees the head did not draft queues the head's KV instead of extending it; 3: a
# plain step's time is the target's alone, the drafter's upkeep measured apart as `idle`; 4:
# the verify curve and the plain step timed in interleaved passes; 5: the idle steps' queued
# work timed with them; 6: the draft and the upkeep timed each right after a target step; 7: a
# draft model's catch-up a token).
MEASURE_VERSION = 7


def cache_key(parts: dict) -> str:
    """The cache file name for a worker described by `parts` (anything that changes costs:
    the machine, the model and its weight format, dtype, threads, the head and its tree)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def load_or_measure(
    worker: SpeculativeWorker,
    parts: dict,
    path: str | None = None,
    tensor_parallel: TensorParallel | None = None,
    catches_up: bool = False,
) -> CostModel | None:
    """The cost model at `path` (given by hand), else the cached one for `parts`, else measured
    now and cached. Under `tensor_parallel` the measuring forwards are collective: rank 0's
    cache decides whether every rank measures (in step) or none does, and only rank 0 keeps
    a model (the scheduler plans by it; other ranks return None)."""
    if path is not None:
        return CostModel.from_dict(json.loads(Path(path).read_text()))
    parts = {**parts, "measure_version": MEASURE_VERSION}
    file = CACHE_DIR / f"{cache_key(parts)}.json"
    cached = _read(file) if tensor_parallel is None or tensor_parallel.rank == 0 else None
    if tensor_parallel is not None:
        found = tensor_parallel.broadcast(int(cached is not None))
        if found and tensor_parallel.rank:
            return None
    if cached is not None:
        return cached
    start = time.perf_counter()
    model = measure(worker, catches_up)
    if tensor_parallel is not None and tensor_parallel.rank:
        return None
    logger.info(
        "measured the speculative cost model in %.1f s (cached at %s): %s",
        time.perf_counter() - start,
        file,
        model.summary(),
    )
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        staging = file.with_name(f".{file.name}.{os.getpid()}")
        staging.write_text(json.dumps({**model.to_dict(), "parts": parts}))
        os.replace(staging, file)  # a process reading it meanwhile sees all of it or none
    except OSError as err:
        logger.warning("could not cache the cost model (%s)", err)
    return model


def _read(file: Path) -> CostModel | None:
    """The cached cost model in `file`, or None (absent or malformed)."""
    if not file.exists():
        return None
    try:
        return CostModel.from_dict(json.loads(file.read_text()))
    except (ValueError, json.JSONDecodeError):
        logger.warning("ignoring a malformed cached cost model at %s", file)
        return None


def timed(fn, repeats: int = REPEATS, warmup: int = 1, before=None) -> float:
    """Median seconds of `fn()` over `repeats` calls, after `warmup` calls; with `before`,
    each call comes right after an untimed `before()` (a round's draft follows the target's
    step, whose weights have pushed the drafter's out of the caches: timed back to back, the
    head's three levels here took 1.8 ms where rounds found them costing 2.6-3.2)."""
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved_ms(fns: dict, passes: int = PASSES) -> dict:
    """Median ms of each of `fns` (key: function) over `passes` passes that call every
    function once, in turn (every other pass in reverse), after one call of each: a machine
    that slows down or speeds up for a few seconds moves every point alike, so the curve's
    shape holds (timed point after point, cached models here differed by 40% in the ratio
    of an 8-node round to a plain step)."""
    for fn in fns.values():
        fn()
    times: dict = {key: [] for key in fns}
    order = list(fns)
    for p in range(passes):
        for key in order if p % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            fns[key]()
            times[key].append(1000 * (time.perf_counter() - t))
    return {key: statistics.median(ts) for key, ts in times.items()}


@torch.inference_mode()
def measure(worker: SpeculativeWorker, catches_up: bool = False) -> CostModel:
    """Measure the curves on `worker` before it serves anyone: request row 0 and the slots
    from 1 up are used as scratch (nothing is allocated yet, and a request that later takes
    them rewrites what it reads). `catches_up`: the drafter computes its KV over the prefix
    when it first drafts (a draft model), timed against its later drafts as `catch_up`."""
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
    step = batch(ForwardMode.DECODE, [prefix_ids[-1]], PREFIX)
    fns = {0: lambda: target.forward(step)}  # 0: a plain step, n: a round of n nodes
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
        fns[n] = lambda wb=tree: worker.forward(wb)
    plain = fns[0]
    times = interleaved_ms(fns)
    decode_one = times.pop(0)
    verify = sorted(times.items())
    draft, idle, catch_up = [(1, 0.0, 0.0)], [(1, 0.0)], 0.0
    drafter = worker.drafter
    if drafter is not None:
        idle = [(b, _idle_ms(worker, step, b)) for b in DRAFT_POINTS]
        seq = torch.tensor([PREFIX])
        draft = []
        levels = max(drafter.num_steps, 2)
        for b in DRAFT_POINTS:
            rows = torch.zeros(b, dtype=torch.int64)
            # below the prefix's last token, in the next slot (a draft model reads its root)
            roots = torch.full((b,), prefix_ids[-1], dtype=torch.int64)
            root_slots = torch.full((b,), slots[PREFIX], dtype=torch.int64)

            def run(levels: int, rows=rows, roots=roots, root_slots=root_slots) -> None:
                drafter.draft(rows, seq.expand(len(rows)), levels, roots, root_slots)

            if catches_up and b == 1:  # its first draft computes its KV over the prefix
                behind = 1000 * timed(lambda run=run: run(1), repeats=1, warmup=0, before=plain)
            first = 1000 * timed(lambda run=run: run(1), before=plain)
            deep = 1000 * timed(lambda run=run, levels=levels: run(levels), before=plain)
            draft.append((b, first, max(deep - first, 0.0) / (levels - 1)))
            if catches_up and b == 1:
                catch_up = max(behind - first, 0.0) / PREFIX
    return CostModel(
        verify=verify, decode_one=decode_one, draft=draft, idle=idle, catch_up=catch_up
    )


def _idle_ms(worker: SpeculativeWorker, step: WorkerBatch, b: int) -> float:
    """The mean ms the drafter adds to a plain step of `b` requests (`worker.observe_step`,
    right after the target's forward as `worker.forward` runs it, the forward untimed) over
    IDLE_STEPS steps, the work it defers for them written at their end and timed with them;
    row 0 taken `b` times (its slot rewritten). Timed back to back, without the forwards
    between, the upkeep read 0.024 ms a step at batch 1 where plain steps with the head awake
    took ~1.6% (~0.08 ms) longer than with it asleep."""
    wide = dataclasses.replace(
        step,
        input_ids=step.input_ids * b,
        positions=step.positions * b,
        out_cache_loc=step.out_cache_loc * b,
        req_pool_indices=step.req_pool_indices * b,
        prefix_lens=step.prefix_lens * b,
        extend_lens=step.extend_lens * b,
        sampling=step.sampling * b,
    )

    def forward() -> tuple:
        result, fb, hidden, captured = worker.target.run(wide, worker.drafter.capture_layers)
        return fb, wide.req_pool_indices, result.next_token_ids, hidden, captured

    worker.observe_step(*forward())
    worker.drafter.flush()
    seconds = 0.0
    for _ in range(IDLE_STEPS):
        args = forward()
        start = time.perf_counter()
        worker.observe_step(*args)
        seconds += time.perf_counter() - start
    start = time.perf_counter()
    worker.drafter.flush()
    seconds += time.perf_counter() - start
    return 1000 * seconds / IDLE_STEPS
