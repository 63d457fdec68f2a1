"""Speed on a CUDA GPU per attention backend, on models of the default's shape and of
Qwen2.5-Coder-1.5B's with random weights made on the device (--load-format dummy: a lent GPU
has neither model's file), in one run.

For each shape and backend: plain decoding tokens/s at each batch size (random prompts of
--prompt-len tokens, up to --max-new-tokens each, greedy, timed by bench/spec.py's `measure`),
and the verify cost curve: ms of one speculative round's target forward for 1..64 tree tokens
over a 256-token prefix, as the tree planner measures it at start-up (NGRAM: no head), against
a plain decode step. Ratios against the first backend (torch: SDPA per request) of the same
shape, measured in the same run. Results to --out (JSON).

    python bench/gpu.py                                   # bf16, default and 1.5b, batches 1,16
    python bench/gpu.py --device cpu --shapes tiny --backends torch --batches 1,2 \\
        --max-new-tokens 8 --prompt-len 16                # the same logic on a CPU (a dry run)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import SHAPES, make_model_dir  # noqa: E402
from bench.spec import measure  # noqa: E402
from spectral import Engine  # noqa: E402


def random_prompts(vocab_size: int, count: int, length: int) -> list[list[int]]:
    """Prompts of `length` random token ids (past bench/shapes.py's special tokens)."""
    rng = random.Random(count)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def release(engine: Engine) -> None:
    engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_backend(model_dir: str, backend: str, args: argparse.Namespace) -> dict:
    common = dict(
        model_path=model_dir,
        dtype=args.dtype,
        device=args.device,
        attention_backend=backend,
        load_format="dummy",
        max_total_tokens=max(args.batches) * (args.prompt_len + args.max_new_tokens) + 4096,
    )
    engine = Engine(**common, max_running_requests=max(args.batches))
    vocab, speeds = engine.model.vocab_size, {}
    for b in args.batches:
        speeds[b], outputs, _ = measure(
            engine, random_prompts(vocab, b, args.prompt_len), args.max_new_tokens
        )
        if any(not out for out in outputs):  # the scheduler ended a request with an error
            release(engine)
            raise RuntimeError(f"batch {b}: a request generated nothing (see the log above)")
    release(engine)
    engine = Engine(**common, speculative_algorithm="NGRAM")
    cost = engine.worker.cost_model
    release(engine)
    return {
        "plain_tok_s": {str(b): round(s, 1) for b, s in speeds.items()},
        "decode_ms": round(cost.decode_one, 3),
        "verify_ms": {str(n): round(ms, 3) for n, ms in cost.verify},
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="default,1.5b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--backends", default="torch,triton,flashinfer")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "gpu.json")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU; torch sees none (--device cpu runs the logic)")

    backends = [b for b in args.backends.split(",") if b]
    skipped = {}
    if "flashinfer" in backends:
        if importlib.util.find_spec("flashinfer") is None:
            skipped["flashinfer"] = "not installed"
        elif args.dtype == "float32":
            skipped["flashinfer"] = "its kernels take bfloat16 and float16 only"
    for name, why in skipped.items():
        print(f"skipping the {name} backend: {why}")
        backends.remove(name)

    results, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in [s for s in args.shapes.split(",") if s]:
            model_dir = make_model_dir(Path(tmp) / shape, shape)
            baseline = None
            for backend in backends:
                try:
                    row = {"shape": shape, "backend": backend}
                    row |= measure_backend(model_dir, backend, args)
                except Exception as err:  # noqa: BLE001 - reported; the other backends still run
                    print(f"{shape:8s} {backend:10s} FAILED: {type(err).__name__}: {err}")
                    failed.append({"shape": shape, "backend": backend, "error": str(err)[:2000]})
                    continue
                baseline = baseline or row
                speeds = "  ".join(
                    f"batch {b} {s:8.1f} tok/s ({s / baseline['plain_tok_s'][b]:4.2f}x)"
                    for b, s in row["plain_tok_s"].items()
                )
                curve = row["verify_ms"]
                points = "  ".join(f"{n}:{ms:.2f}" for n, ms in curve.items())
                print(f"{shape:8s} {backend:10s} {speeds}")
                print(
                    f"{'':8s} {'':10s} decode step {row['decode_ms']:.2f} ms; verify ms by "
                    f"tree tokens {points}"
                )
                results.append(row)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "device": device,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "skipped": skipped,
        "runs": results,
        "failed": failed,
    }
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
