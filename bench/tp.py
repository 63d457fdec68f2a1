"""Tensor parallelism on this machine: decode steps of one worker (all threads) against two
tensor-parallel ranks (gloo, the threads split between them), in one run.

For each model (a GGUF of the kit, cut as it loads) and batch size: ms per decode step (median
of --steps after a prefill of --prefix tokens a request), tokens/s, and for the ranks the share
of a step spent in collectives (the all-reduces after o and down, the vocabulary's embedding sum
and the logits' gather, timed on rank 0 around each call), plus each rank's weight bytes
against one worker's. On two cores tensor parallelism is about correctness and memory, not
speed: the ranks' collectives are what it costs.

    python bench/tp.py --models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --batches 1,8

(the default model's 9 heads do not split over 2 ranks; the kit's Qwen models do). Writes
bench/out/tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import model_file  # noqa: E402

OUT = Path(__file__).parent / "out"


def decode_steps(worker, batch: int, prefix: int, steps: int) -> list[float]:
    """Seconds of each of `steps` greedy decode steps of `batch` requests after their prefill."""
    from spectral.core.forward import ForwardMode
    from spectral.core.worker_io import RequestSampling, WorkerBatch
    from spectral.sampling_params import SamplingParams

    greedy = RequestSampling(SamplingParams(temperature=0.0, max_new_tokens=steps + 1))
    span = prefix + steps + 2
    rows = list(range(batch))
    ids = [(17 * b + 5 * i) % 5000 + 10 for b in rows for i in range(prefix)]
    wb = WorkerBatch(
        ForwardMode.EXTEND,
        ids,
        [i for _ in rows for i in range(prefix)],
        [1 + span * b + i for b in rows for i in range(prefix)],
        rows,
        [0] * batch,
        [prefix] * batch,
        [greedy] * batch,
    )
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        result = worker.forward(wb)
        if step:  # the prefill is not a decode step
            times.append(time.perf_counter() - start)
        now = prefix + step
        wb = WorkerBatch(
            ForwardMode.DECODE,
            result.next_token_ids,
            [now] * batch,
            [1 + span * b + now for b in rows],
            rows,
            [now] * batch,
            [1] * batch,
            [greedy] * batch,
        )
    return times


def make_worker(path: Path, batch: int, span: int, tp=None):
    from spectral.models.resolve import model_files_dir
    from spectral.worker.model_worker import ModelWorker

    return ModelWorker(
        model_files_dir(str(path)),
        torch.float32,
        "cpu",
        max_total_tokens=batch * span + 8,
        max_running_requests=batch,
        max_context_len=span,
        gguf_file=str(path),
        gguf_int8=True,
        tensor_parallel=tp,
    )


def one_worker(path: Path, batches: list[int], prefix: int, steps: int) -> dict:
    from spectral.layers.linear import weight_bytes

    torch.set_num_threads(os.cpu_count() or 1)
    worker = make_worker(path, max(batches), prefix + steps + 2)
    out = {"weight_bytes": weight_bytes(worker.model)}
    for batch in batches:
        out[batch] = statistics.median(decode_steps(worker, batch, prefix, steps))
    return out


def _rank(rank: int, world: int, init: str, path: str, batches, prefix, steps, result) -> None:
    from spectral.layers import parallel
    from spectral.layers.linear import weight_bytes
    from spectral.layers.parallel import TensorParallel

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    for name in ("row_parallel_sum", "gather_columns"):  # the embedding sum is a row sum
        setattr(parallel, name, timed(getattr(parallel, name)))
    try:
        worker = make_worker(
            Path(path), max(batches), prefix + steps + 2, TensorParallel(rank, world)
        )
        out = {"weight_bytes": weight_bytes(worker.model)}
        for batch in batches:
            spent[0] = 0.0
            times = decode_steps(worker, batch, prefix, steps)
            out[batch] = (statistics.median(times), spent[0] / sum(times))
        if rank == 0:
            result.update(out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default="tp.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in args.models.split(","):
        path = model_file(name)
        one = one_worker(path, batches, args.prefix, args.steps)
        with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
            shared = manager.dict()
            mp.spawn(
                _rank,
                args=(2, f"file://{tmp}/rdv", str(path), batches, args.prefix, args.steps, shared),
                nprocs=2,
                join=True,
            )
            two = dict(shared)
        share = two["weight_bytes"] / one["weight_bytes"]
        print(
            f"{name}: weights a rank {two['weight_bytes'] / 2**20:.0f} MiB of one worker's "
            f"{one['weight_bytes'] / 2**20:.0f} ({share:.2f})"
        )
        for batch in batches:
            ms1 = one[batch] * 1e3
            ms2, collective = two[batch][0] * 1e3, two[batch][1]
            print(
                f"  batch {batch:2d}: TP 1 {ms1:7.1f} ms/step ({batch / ms1 * 1e3:6.1f} tok/s)   "
                f"TP 2 {ms2:7.1f} ms/step ({batch / ms2 * 1e3:6.1f} tok/s, {ms1 / ms2:.2f}x), "
                f"collectives {collective:.0%} of a step"
            )
            rows.append(
                {
                    "model": name,
                    "batch": batch,
                    "tp1_ms": round(ms1, 2),
                    "tp2_ms": round(ms2, 2),
                    "speedup": round(ms1 / ms2, 3),
                    "collective_share": round(collective, 3),
                    "rank_weight_share": round(share, 3),
                }
            )
    OUT.mkdir(exist_ok=True)
    (OUT / args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
