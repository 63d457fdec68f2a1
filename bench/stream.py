"""How close the GGUF matmuls come to the memory's speed when their weights are not in cache
(as in a decode step, which streams every weight once): GB/s of weights read by builds of the
same sources that differ in how they ask for the weights ahead (vec.h's prefetch_ahead): no
hint, non-temporal (`prefetch_nta`) and into every cache level (`prefetch_t0`), at a few rows
of x, on random blocks of a 1.5B model's shapes, each matrix copied enough times to span ~600
MB and the copies read in turn. The roof, measured in the same run: torch's sum over 512 MB of
float32 (bench/cost_curve.py's probe). Builds alternate, five rounds; medians. The runtime's
build takes the hint cpu_kernels.prefetch_locality() names for this CPU.

    python bench/stream.py [--rows 1,4] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cost_curve import bandwidth_probe  # noqa: E402
from spectral.kernels.cpu_kernels import load_cpu_kernels, prefetch_locality  # noqa: E402
from spectral.layers.gguf_blocks import LAYOUTS, pack_blocks, pack_int8  # noqa: E402
from tests.test_gguf_blocks import random_blocks  # noqa: E402

# (format, output rows, inputs): a Q4_K gate|up, the Q6_K down projection and LM head.
SHAPES = [("Q4_K", 17920, 1536), ("Q6_K", 1536, 8960), ("Q6_K", 151936, 1536)]
SPAN = 600e6  # bytes of copies a measurement reads


def read_all(kernels, x: torch.Tensor, copies: list[torch.Tensor], layout: str, n: int) -> float:
    """Seconds of x times each copy of the weights in turn."""
    t = time.perf_counter()
    for weights in copies:
        kernels.gguf_linear(x, weights, layout, n, None)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "stream.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builds = {
        "none": load_cpu_kernels("noprefetch"),
        "nta": load_cpu_kernels("prefetch_nta"),
        "t0": load_cpu_kernels("prefetch_t0"),
    }
    if any(k is None for k in builds.values()):
        sys.exit("the CPU kernels do not build here")
    kernels = builds["none"]
    print(f"the runtime's build here: {'t0' if prefetch_locality() == 3 else 'nta'}")
    roof = bandwidth_probe(5)
    print(
        f"roof: a streaming read (bench/cost_curve.py's), {args.threads} threads: {roof:.1f} GB/s"
    )
    rows = []
    for fmt, n, k in SHAPES:
        raw = torch.from_numpy(random_blocks(fmt, n, k // 256, 0))
        paths = {
            "exact": (pack_blocks(raw, fmt, k, kernels), LAYOUTS[fmt]),
            "int8": pack_int8(raw, fmt, k, kernels),
        }
        for path, (data, layout) in paths.items():
            nbytes = data.numel() * data.element_size()
            copies = [data] + [data.clone() for _ in range(max(1, round(SPAN / nbytes)) - 1)]
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k)
                speeds = {name: [] for name in builds}
                for _ in range(args.rounds):
                    for name, mod in builds.items():
                        s = read_all(mod, x, copies, layout, n)
                        speeds[name].append(nbytes * len(copies) / s / 1e9)
                med = {name: statistics.median(v) for name, v in speeds.items()}
                row = dict(format=fmt, n=n, k=k, path=path, rows=m, gb_s=med)
                rows.append(row)
                cells = "  ".join(
                    f"{name} {med[name]:5.1f} ({med[name] / roof:3.0%}, "
                    f"{med[name] / med['none']:.2f}x)"
                    for name in builds
                )
                print(f"{fmt} {n:6d} x {k:4d} {path:5s} m={m}: GB/s  {cells}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"roof_gb_s": roof, "threads": args.threads, "rows": rows}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
