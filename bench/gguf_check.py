"""Every block tensor of a real GGUF against gguf's own dequantization: spectral's decoder
(spectral/layers/gguf_blocks.py) over the whole tensor, and gguf_linear's expansion of the
packed tensor at 64 random input columns (a slice of the identity), in float32 and bfloat16.

    python bench/gguf_check.py --model qwen2.5-coder-1.5b      # a kit model (bench/models.py)
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import model_file  # noqa: E402
from spectral.kernels.cpu_kernels import load_cpu_kernels  # noqa: E402
from spectral.layers.gguf_blocks import BLOCKS, LAYOUTS, decode, pack_blocks  # noqa: E402


def check_tensor(tensor: gguf.ReaderTensor, kernels, columns: int, rng) -> bool:
    rows = np.asarray(tensor.data)
    expected = torch.from_numpy(gguf.quants.dequantize(rows, tensor.tensor_type))
    kind = tensor.tensor_type.name
    raw = torch.from_numpy(np.ascontiguousarray(rows))
    if not torch.equal(decode(raw, kind).dequantize(), expected):
        return False
    n, k = expected.shape
    picked = torch.from_numpy(rng.choice(k, size=min(columns, k), replace=False))
    packed = pack_blocks(raw, kind, k, kernels)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(len(picked), k, dtype=dtype)
        x[torch.arange(len(picked)), picked] = 1
        got = kernels.gguf_linear(x, packed, LAYOUTS[kind], n, None).T
        if not torch.equal(got, expected[:, picked].to(dtype)):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a kit model or a .gguf")
    ap.add_argument("--columns", type=int, default=64)
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    reader = gguf.GGUFReader(str(model_file(args.model)))
    rng = np.random.default_rng(0)
    counts: collections.Counter = collections.Counter()
    failed = []
    start = time.perf_counter()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in BLOCKS:
            counts[f"{kind} (not a block format decoded here)"] += 1
            continue
        ok = check_tensor(tensor, kernels, args.columns, rng)
        counts[f"{kind} {'exact' if ok else 'DIFFERS'}"] += 1
        if not ok:
            failed.append(tensor.name)
    for what, count in sorted(counts.items()):
        print(f"{what:45s} {count:4d} tensors")
    print(f"{time.perf_counter() - start:.0f} s; {'all exact' if not failed else failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
