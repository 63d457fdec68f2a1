"""What one target forward costs for M = 1..64 new tokens, beside the machine's roof.

Two shapes, for each dtype and weight path (a GGUF model's own blocks through spectral's
kernels, its dequantized weights packed for them, or PyTorch alone):
- verify: one request, M new tokens over a prefix of --prefix tokens under a tree mask (a
  chain, the densest tree), logits for every new token: what a speculative round verifies;
- batch: M requests, one new token each over its own prefix: a decode step of M requests.

For each: ms per forward (median of --repeats), the ratio to M = 1, and the achieved GFLOP/s
and GB/s (weights read once per forward, KV read per new token). The roof is measured in the
same run: a streaming-read probe (GB/s) and torch's GEMM on a large product (GFLOP/s).

    python bench/cost_curve.py [--dtypes float32,bfloat16] [--kernels gguf,packed,off]
                               [--ms 1,2,4,...] [--prefix 200]

Prints a table per dtype and writes bench/out/cost_curve.json (and cost_curve.png where
matplotlib is installed). Every later decision about tree sizes reads this curve.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import pyplot  # noqa: E402
from bench.models import model_file  # noqa: E402
from spectral.core.forward import ForwardBatch, ForwardMode  # noqa: E402
from spectral.layers.linear import Linear  # noqa: E402
from spectral.models.resolve import gguf_source, model_files_dir  # noqa: E402
from spectral.worker.cost_measure import timed as measured  # noqa: E402
from spectral.worker.model_worker import ModelWorker  # noqa: E402

DEFAULT_MS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
OUT = Path(__file__).parent / "out"


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls, after two warm-up calls."""
    return measured(fn, repeats, warmup=2)


def bandwidth_probe(repeats: int) -> float:
    """GB/s of a streaming read: summing 512 MB, far larger than any cache."""
    data = torch.ones(128 * 2**20, dtype=torch.float32)
    return data.numel() * 4 / timed(lambda: data.sum(), repeats) / 1e9


def gemm_probe(dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of torch's GEMM on a 1024 x 1024 x 1024 product in `dtype`."""
    a = torch.randn(1024, 1024, dtype=dtype)
    b = torch.randn(1024, 1024, dtype=dtype)
    return 2 * 1024**3 / timed(lambda: F.linear(a, b), repeats) / 1e9


class Shapes:
    """Builds verify- and batch-shaped forwards on a worker whose KV holds the prefixes."""

    def __init__(self, worker: ModelWorker, prefix: int, max_m: int) -> None:
        self.worker = worker
        self.prefix = prefix
        # Row 0 for the verify shape (prefix + max_m slots); rows 1..max_m for the batch shape.
        slots = iter(range(1, worker.num_kv_slots))
        self.rows = {}
        for row in range(max_m + 1):
            extra = max_m if row == 0 else 1
            self.rows[row] = [next(slots) for _ in range(prefix + extra)]
            worker.req_to_token.write(row, 0, self.rows[row][:prefix])
        ids = torch.randint(3, worker.config.vocab_size, (prefix,))
        self.prefill(ids)

    def prefill(self, ids: torch.Tensor) -> None:
        """Every row's prefix in the KV cache (the same tokens: their values do not matter)."""
        for row, slots in self.rows.items():
            batch = self.batch(
                ForwardMode.EXTEND, [row], ids, [0], [self.prefix], slots[: self.prefix]
            )
            self.worker.forward_logits(batch)

    def batch(self, mode, rows, ids, prefix_lens, extend_lens, out_loc, mask=None) -> ForwardBatch:
        positions = [p + i for p, e in zip(prefix_lens, extend_lens) for i in range(e)]
        return ForwardBatch(
            mode=mode,
            input_ids=ids,
            positions=torch.tensor(positions),
            out_cache_loc=torch.tensor(out_loc),
            req_pool_indices=torch.tensor(rows),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            custom_mask=mask,
            logits_rows="all" if mode == ForwardMode.TARGET_VERIFY else "last",
        )

    def verify(self, m: int) -> ForwardBatch:
        slots = self.rows[0][self.prefix : self.prefix + m]
        self.worker.req_to_token.table[0, self.prefix : self.prefix + m] = torch.tensor(slots)
        chain = torch.tril(torch.ones(m, m, dtype=torch.bool)).flatten()
        ids = torch.randint(3, self.worker.config.vocab_size, (m,))
        return self.batch(ForwardMode.TARGET_VERIFY, [0], ids, [self.prefix], [m], slots, chain)

    def decode(self, m: int) -> ForwardBatch:
        rows = list(range(1, m + 1))
        slots = [self.rows[r][self.prefix] for r in rows]
        for r, s in zip(rows, slots):
            self.worker.req_to_token.table[r, self.prefix] = s
        ids = torch.randint(3, self.worker.config.vocab_size, (m,))
        return self.batch(ForwardMode.DECODE, rows, ids, [self.prefix] * m, [1] * m, slots)


def forward_work(worker: ModelWorker, shape: str, m: int, prefix: int) -> tuple[float, float]:
    """(FLOP, bytes) of one forward: matmuls over every weight, attention over the prefix, the
    LM head over every new token (each gets logits); weights read once (as the kernels store
    them), KV once per request."""
    cfg = worker.config
    model = worker.model
    elem = torch.finfo(worker.dtype).bits // 8
    # Weights by shape: a Linear served from GGUF blocks keeps no dense parameter.
    layer_params = sum(
        m.in_features * m.out_features for m in model.layers.modules() if isinstance(m, Linear)
    ) + sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    head_params = cfg.vocab_size * cfg.hidden_size
    kv_width = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    attn_keys = (prefix + (m + 1) / 2) * m if shape == "verify" else (prefix + 1) * m
    attn_flop = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attn_keys
    flop = 2 * layer_params * m + 2 * head_params * m + attn_flop  # m rows get logits
    kv_tokens = prefix + m if shape == "verify" else (prefix + 1) * m
    packs = [m.packed for m in model.modules() if isinstance(m, Linear)] + [model.lm_head_packed]
    if all(p is not None for p in packs):  # what the kernels stream: dense or GGUF blocks
        # each once: the LM head's is also a Linear's where it is one
        weight_bytes = sum({id(p): p.nbytes for p in packs}.values())
    else:
        weight_bytes = (layer_params + head_params) * elem
    return flop, weight_bytes + kv_tokens * kv_width * elem


def curve(worker: ModelWorker, ms: list[int], prefix: int, repeats: int) -> dict[str, list[dict]]:
    shapes = Shapes(worker, prefix, max(ms))
    out: dict[str, list[dict]] = {"verify": [], "batch": []}
    for shape, build in (("verify", shapes.verify), ("batch", shapes.decode)):
        for m in ms:
            batch = build(m)
            seconds = timed(lambda b=batch: worker.forward_logits(b), repeats)
            flop, nbytes = forward_work(worker, shape, m, prefix)
            out[shape].append(
                {
                    "m": m,
                    "ms": 1000 * seconds,
                    "gflops": flop / seconds / 1e9,
                    "gbps": nbytes / seconds / 1e9,
                }
            )
        base = out[shape][0]["ms"]
        for row in out[shape]:
            row["x_m1"] = row["ms"] / base
    return out


def plot(results: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, shape in zip(axes, ("verify", "batch")):
        for name, run in results["runs"].items():
            rows = run[shape]
            ax.plot([r["m"] for r in rows], [r["x_m1"] for r in rows], marker="o", label=name)
        ax.set_title(f"{shape}-shaped forward")
        ax.set_xlabel("new tokens M")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cost / cost at M = 1")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--model", default=None, help="a kit model (bench/models.py); overrides it")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument(
        "--kernels",
        default="gguf,packed,off",
        help="matmul paths to measure: gguf (a GGUF model's own blocks through spectral's "
        "kernels, exact: --quantization gguf), gguf-int8 (the same blocks through the "
        "integer path: --quantization auto's choice on a CPU), packed (the dequantized "
        "weights packed for them: --quantization none), off (PyTorch only: --disable-cpu-kernels)",
    )
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ns = ap.parse_args()
    if ns.model is not None:
        ns.model_path = str(model_file(ns.model))
    ms = [int(m) for m in ns.ms.split(",")]
    model_dir = model_files_dir(ns.model_path)
    gguf = gguf_source(ns.model_path)
    results: dict = {
        "machine": {
            "threads": torch.get_num_threads(),
            "stream_read_gbps": bandwidth_probe(ns.repeats),
        },
        "prefix": ns.prefix,
        "runs": {},
    }
    for dtype_name in ns.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        results["machine"][f"gemm_gflops_{dtype_name}"] = gemm_probe(dtype, ns.repeats)
        for kernels in ns.kernels.split(","):
            worker = ModelWorker(
                model_dir,
                dtype=dtype,
                device="cpu",
                max_total_tokens=(ns.prefix + 1) * (max(ms) + 1) + max(ms) + 16,
                max_running_requests=max(ms) + 1,
                max_context_len=ns.prefix + max(ms) + 1,
                use_cpu_kernels=kernels != "off",
                gguf_file=str(gguf) if gguf is not None else None,
                gguf_native=kernels.startswith("gguf"),
                gguf_int8=kernels == "gguf-int8",
            )
            name = f"{dtype_name}, {kernels}"
            results["runs"][name] = curve(worker, ms, ns.prefix, ns.repeats)
            del worker
    machine = results["machine"]
    print(
        f"roof: streaming read {machine['stream_read_gbps']:.1f} GB/s; "
        + ", ".join(
            f"GEMM {k.removeprefix('gemm_gflops_')} {v:.0f} GFLOP/s"
            for k, v in machine.items()
            if k.startswith("gemm_")
        )
    )
    for name, run in results["runs"].items():
        for shape in ("verify", "batch"):
            print(f"\n{name}, {shape}-shaped (prefix {ns.prefix}):")
            print("   M      ms   x M=1  GFLOP/s   GB/s")
            for r in run[shape]:
                print(
                    f"{r['m']:4d} {r['ms']:7.2f} {r['x_m1']:7.2f} {r['gflops']:8.1f} "
                    f"{r['gbps']:6.1f}"
                )
    OUT.mkdir(exist_ok=True)
    (OUT / "cost_curve.json").write_text(json.dumps(results, indent=2))
    if plot(results, OUT / "cost_curve.png"):
        print(f"\nplot: {OUT / 'cost_curve.png'}")


if __name__ == "__main__":
    main()
