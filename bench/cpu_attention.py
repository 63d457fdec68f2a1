"""The CPU attention kernel (kernels.decode_attention) against the memory it must read: for the
default model's and the 1.5B's heads, plain decode steps of 1, 4 and 16 requests and verified
trees of 4 and 8 nodes a request, over contexts of 256 and 1024 tokens in scattered KV slots.
Each case prints the kernel's time a layer, the bytes of keys and values it reads over that
time, and that rate as a fraction of a plain copy of as many bytes in the same run (the
memory's rate on this machine now); and the multiply-adds a second. Writes
bench/out/cpu-attention.json.

    python bench/cpu_attention.py [--contexts 256,1024] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectral.kernels.cpu_kernels import load_cpu_kernels  # noqa: E402
from spectral.worker.cost_measure import timed  # noqa: E402

OUT = Path(__file__).parent / "out" / "cpu-attention.json"
# (name, heads, kv heads, head dim, layers)
MODELS = [("default", 9, 3, 64, 30), ("qwen2.5-1.5b", 12, 2, 128, 28)]
# (requests, rows a request): decode steps, then trees (every node over the prefix and a chain)
CASES = [(1, 1), (4, 1), (16, 1), (1, 4), (1, 8), (4, 4)]


def case_inputs(requests: int, per: int, context: int, kv_heads: int, dim: int, heads: int):
    """A pool of scattered slots holding `requests` contexts, and `per` query rows a request
    (row i over the context and i more nodes): (q, k_buf, v_buf, indices, lens)."""
    slots = requests * (context + per) + 1
    k_buf = torch.randn(slots, kv_heads, dim)
    v_buf = torch.randn(slots, kv_heads, dim)
    perm = torch.randperm(slots - 1) + 1
    rows = []
    for r in range(requests):
        own = perm[r * (context + per) : (r + 1) * (context + per)].tolist()
        rows += [own[: context + i] for i in range(1, per + 1)]
    indices = torch.zeros(len(rows), context + per, dtype=torch.int64)
    for i, row in enumerate(rows):
        indices[i, : len(row)] = torch.tensor(row)
    lens = torch.tensor([len(row) for row in rows])
    q = torch.randn(len(rows), heads, dim)
    return q, k_buf, v_buf, indices, lens


def copy_rate(nbytes: int) -> float:
    """Bytes a second of a plain copy of `nbytes` (float32, out of the caches)."""
    src = torch.randn(max(nbytes // 4, 1 << 20))
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 9)
    return src.numel() * 4 * 2 / seconds  # read and written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the CPU kernels did not build")
    memory = copy_rate(256 << 20)
    print(f"threads {torch.get_num_threads()}, vector bits {kernels.vector_bits()}, "
          f"copy {memory / 1e9:.1f} GB/s")  # fmt: skip
    results = []
    for name, heads, kv_heads, dim, layers in MODELS:
        for context in [int(c) for c in args.contexts.split(",")]:
            for requests, per in CASES:
                q, k_buf, v_buf, indices, lens = case_inputs(
                    requests, per, context, kv_heads, dim, heads
                )
                args = (q, k_buf, v_buf, indices, lens, dim**-0.5)
                seconds = timed(lambda args=args: kernels.decode_attention(*args), 9)
                # keys and values each request's rows read (shared: once a request)
                read = requests * (context + per) * kv_heads * dim * 4 * 2
                macs = int(lens.sum()) * heads * dim * 2
                row = {
                    "model": name,
                    "context": context,
                    "requests": requests,
                    "rows_a_request": per,
                    "us_a_layer": round(seconds * 1e6, 1),
                    "ms_a_step": round(seconds * 1e3 * layers, 2),
                    "gb_s": round(read / seconds / 1e9, 2),
                    "of_copy": round(read / seconds / memory, 3),
                    "gmac_s": round(macs / seconds / 1e9, 2),
                }
                results.append(row)
                print(
                    f"{name:13s} ctx {context:5d}  {requests:2d} x {per} rows  "
                    f"{row['us_a_layer']:8.1f} us a layer ({row['ms_a_step']:6.2f} ms a step)  "
                    f"{row['gb_s']:6.2f} GB/s = {row['of_copy']:.2f} of a copy  "
                    f"{row['gmac_s']:6.2f} GMAC/s"
                )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(
        json.dumps(
            {"threads": torch.get_num_threads(), "copy_gb_s": memory / 1e9, "cases": results},
            indent=1,
        )
        + "\n"  # fmt: skip
    )
    least = min(results, key=lambda r: r["of_copy"])
    print(f"least fraction of a copy's rate: {least['of_copy']:.2f} ({least['model']}, context "
          f"{least['context']}, {least['requests']} x {least['rows_a_request']} rows)")  # fmt: skip


if __name__ == "__main__":
    main()
