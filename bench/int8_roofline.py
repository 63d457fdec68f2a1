"""The integer path's tiles against this CPU's int8 peak (kernels.int8_peak_macs: the tiles' one
instruction on independent accumulators, all threads): each tile's multiply-adds a second
(m * n * k / median time of gguf_linear_q8 on x quantized beforehand) and its fraction of the
peak, at a few rows. The default shape keeps the weights within the caches (the compute
roof); `--real` adds the 1.5B model's shapes, whose weights stream from memory. Writes
bench/out/int8-roofline.json.

    python bench/int8_roofline.py [--rows 1,2,4,8,16] [--real] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectral.kernels.cpu_kernels import load_cpu_kernels  # noqa: E402
from spectral.layers.gguf_blocks import BLOCKS, pack_int8  # noqa: E402
from spectral.worker.cost_measure import timed  # noqa: E402
from tests.test_gguf_blocks import random_blocks  # noqa: E402

OUT = Path(__file__).parent / "out" / "int8-roofline.json"
# The tiles the integer path serves models with: the 1.5B's (Q4_K and Q6_K in
# their compact layouts) and the default model's (Q4_1, Q8_0). (Q8_0h, Q6_K regrouped for the
# exact path, serves no model on the integer path since Q6_K has its own layout.)
TILES = ["Q4_K", "Q6_K", "Q4_1", "Q8_0"]
CACHED_SHAPE = (2048, 1536)  # (n, k): 1.7 to 3.3 MB of weights, within L3
# The 1.5B model's shapes per format: the down projection and the gate | up projection.
REAL_SHAPES = {"Q6_K": (1536, 8960), "Q4_K": (17920, 1536)}
ROWS_AT_THE_END = 8  # the rows whose least fraction closes the table
# Calls before the timed ones: the first tile timed after packing ran at 0.38x its rate at
# M = 1 (an AMD EPYC) with one call of warm-up; the next cases, 0.94-0.97x.
WARM_S = 0.2


def packed(kernels, fmt: str, n: int, k: int) -> tuple[torch.Tensor, str]:
    """Random blocks of `fmt` packed for the integer path: (data, gguf_linear_q8's layout
    name)."""
    raw = torch.from_numpy(random_blocks(fmt, n, k // BLOCKS[fmt][0], 0))
    data, layout = pack_int8(raw, fmt, k, kernels)
    return data, layout.removesuffix("+q8")


def tile_rate(kernels, data: torch.Tensor, layout: str, m: int, n: int, k: int) -> float:
    """Multiply-adds a second of the tile over m rows, x quantized once beforehand."""
    q, d, s, *shift = kernels.quantize_q8(torch.randn(m, k), layout in ("Q4_K", "Q6_K"))
    shift = shift[0] if shift else None

    def call():
        return kernels.gguf_linear_q8(q, d, s, data, layout, n, None, False, shift)

    began = time.perf_counter()
    while time.perf_counter() - began < WARM_S:
        call()
    seconds = timed(call, 9)
    return m * n * k / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--real", action="store_true", help="also the 1.5B model's shapes")
    ap.add_argument("--threads", type=int, help="torch's threads (default: as torch has them)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None or kernels.vector_bits() == 0:
        sys.exit("the CPU kernels are not built with vectors: no int8 peak to measure")
    rows = [int(r) for r in args.rows.split(",")]
    peak = max(kernels.int8_peak_macs(0.5) for _ in range(3))
    threads = torch.get_num_threads()
    print(f"int8 peak: {peak / 1e9:.1f} GMAC/s on {threads} threads (vnni {kernels.int8_vnni()})")
    cases = [(tile, *CACHED_SHAPE) for tile in TILES]
    if args.real:
        cases += [(tile, *shape) for tile, shape in REAL_SHAPES.items()]
    results = []
    print(f"{'tile':>6} {'n x k':>12}  " + "  ".join(f"m={m:<2}  GMAC/s  peak" for m in rows))
    for tile, n, k in cases:
        data, layout = packed(kernels, tile, n, k)
        cells = []
        for m in rows:
            rate = tile_rate(kernels, data, layout, m, n, k)
            results.append(
                {"tile": tile, "n": n, "k": k, "m": m, "macs": rate, "fraction": rate / peak}
            )
            cells.append(f"{rate / 1e9:12.1f} {rate / peak:5.2f}")
        print(f"{tile:>6} {f'{n} x {k}':>12}  " + "  ".join(cells))
    at_end = [r for r in results if r["m"] == ROWS_AT_THE_END and (r["n"], r["k"]) == CACHED_SHAPE]
    if at_end:
        least = min(at_end, key=lambda r: r["fraction"])
        print(f"least fraction at m = {ROWS_AT_THE_END}: {least['fraction']:.2f} ({least['tile']})")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(
        json.dumps({"peak_macs": peak, "threads": threads, "tiles": results}, indent=1) + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
