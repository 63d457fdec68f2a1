"""One GGUF matmul at a few rows, the exact path against the integer path (`gguf-int8`), on
random blocks of a 1.5B model's shapes: the exact layout (expanded in registers), the integer
path over the same layout regrouped, and the integer path's compact layout (Q4_K, Q6_K).
Median ms of 9 calls per cell and the ratio to the exact path, measured in the same run.

    python bench/int8_kernels.py [--rows 1,4,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectral.kernels.cpu_kernels import load_cpu_kernels  # noqa: E402
from spectral.layers.gguf_blocks import LAYOUTS, pack_blocks, pack_int8  # noqa: E402
from spectral.worker.cost_measure import timed  # noqa: E402
from tests.test_gguf_blocks import random_blocks  # noqa: E402

# (format, output rows, inputs): the 1.5B's Q6_K LM head and down projection, a Q4_K gate|up.
SHAPES = [("Q6_K", 151936, 1536), ("Q6_K", 1536, 8960), ("Q4_K", 17920, 1536)]


def median_ms(fn, repeats: int = 9) -> float:
    return 1000 * timed(fn, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8")
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    for fmt, n, k in SHAPES:
        raw = torch.from_numpy(random_blocks(fmt, n, k // 256, 0))
        layout = LAYOUTS[fmt]
        exact = pack_blocks(raw, fmt, k, kernels)
        paths = {
            "exact": (exact, layout),
            "int8": (kernels.pack_q8_layout(exact, layout, n, k, False)[0], layout + "+q8"),
            "int8 compact": pack_int8(raw, fmt, k, kernels),
        }
        sizes = ", ".join(f"{name} {data.nbytes / n / k:.2f}" for name, (data, _) in paths.items())
        print(f"{fmt} {n} x {k} (bytes a weight: {sizes})")
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k)
            ms = {
                name: median_ms(
                    lambda d=data, t=name_, x=x, n=n: kernels.gguf_linear(x, d, t, n, None)
                )
                for name, (data, name_) in paths.items()
            }
            cells = "  ".join(
                f"{name} {v:7.2f} ({ms['exact'] / v:4.2f}x)" for name, v in ms.items()
            )
            print(f"  m = {m:2d}: {cells}")


if __name__ == "__main__":
    main()
