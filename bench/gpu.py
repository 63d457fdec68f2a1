"""Decoding speed on a CUDA GPU: every attention backend, plainly and with EAGLE3, in one run.

MT-Bench first turns with the model's chat template, greedy. For each batch size and backend it
prints tokens/s of plain decoding, then with EAGLE3 (the shipped head for the default model):
tokens/s, the speedup over the same backend's plain decoding, τ (tokens per round and request)
and how many outputs equal the plain ones; and each backend's plain speed against the first
backend's (by default torch: SDPA per request), the baseline of the run. Results also go to
bench/out/gpu.json.

    python bench/gpu.py                                  # bf16, batches 1 and 16
    python bench/gpu.py --dtype float32 --backends torch,triton
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import chat, mtbench_first_turns  # noqa: E402
from spec import measure  # noqa: E402

from spectral import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--backends", default="torch,triton,flashinfer")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft", default="default", help="EAGLE3 head directory")
    ap.add_argument("--out", default="gpu.json", help="file name under bench/out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU; torch sees none on this machine")

    backends = [b for b in args.backends.split(",") if b]
    if "flashinfer" in backends and importlib.util.find_spec("flashinfer") is None:
        print("flashinfer is not installed: skipping its backend")
        backends.remove("flashinfer")
    questions = mtbench_first_turns(args.num_prompts)
    runs = []
    for size in [int(b) for b in args.batches.split(",") if b]:
        baseline = None
        for backend in backends:
            common = dict(
                model_path=args.model_path,
                dtype=args.dtype,
                device="cuda",
                attention_backend=backend,
                max_running_requests=size,
                max_total_tokens=65536,
            )
            engine = Engine(**common)
            prompts = [chat(engine.tokenizer, q) for q in questions]
            plain, plain_out, _ = measure(engine, prompts, args.max_new_tokens)
            engine.shutdown()
            engine = Engine(
                **common,
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=args.draft,
            )
            spec, spec_out, tau = measure(engine, prompts, args.max_new_tokens)
            engine.shutdown()
            gc.collect()
            torch.cuda.empty_cache()
            baseline = baseline or plain
            same = sum(a == b for a, b in zip(spec_out, plain_out))
            runs.append(
                {
                    "batch": size,
                    "backend": backend,
                    "plain_tok_s": round(plain, 2),
                    "plain_vs_torch_backend": round(plain / baseline, 3),
                    "eagle3_tok_s": round(spec, 2),
                    "speedup": round(spec / plain, 3),
                    "accept_length": round(tau, 3),
                    "identical_outputs": f"{same}/{len(prompts)}",
                }
            )
            print(
                f"batch {size:3d}  {backend:<10s} plain {plain:8.1f} tok/s "
                f"({plain / baseline:4.2f}x torch backend)  EAGLE3 {spec:8.1f} tok/s "
                f"{spec / plain:4.2f}x  τ {tau:4.2f}  identical {same}/{len(prompts)}"
            )
    out = Path(__file__).resolve().parent / "out" / args.out
    out.parent.mkdir(exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "num_prompts": len(questions),
        "max_new_tokens": args.max_new_tokens,
        "runs": runs,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
