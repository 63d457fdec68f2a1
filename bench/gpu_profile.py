"""Where a decode step's time goes on the device: torch's profiler over plain greedy decoding of
one request on a model of a bench/shapes.py shape with random weights, per attention backend.
Prints the operators by host (self CPU) time, and how often the host waited on the device
(synchronisations, blocking copies) per generated token.

    python bench/gpu_profile.py --backends triton,torch          # on a GPU
    python bench/gpu_profile.py --device cpu --shapes tiny --backends torch --dtype float32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import make_model_dir  # noqa: E402
from spectral import Engine  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def profile_backend(model_dir: str, backend: str, args: argparse.Namespace) -> None:
    engine = Engine(
        model_path=model_dir,
        dtype=args.dtype,
        device=args.device,
        attention_backend=backend,
        load_format="dummy",
        max_total_tokens=8192,
    )
    prompt = [[3 + (7 * i) % 1000 for i in range(args.prompt_len)]]
    params = {"temperature": 0, "max_new_tokens": args.tokens, "ignore_eos": True}
    engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 4})
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        engine.generate(input_ids=prompt, sampling_params=params)
    engine.shutdown()
    averages = prof.key_averages()
    print(f"== {backend}: {args.tokens} tokens after a {args.prompt_len}-token prompt")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    for event in averages:
        if event.key.startswith(WAITS):
            print(f"{event.key}: {event.count / args.tokens:.1f} per token")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="default")
    ap.add_argument("--backends", default="triton,torch")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / args.shape, args.shape)
        for backend in [b for b in args.backends.split(",") if b]:
            profile_backend(model_dir, backend, args)


if __name__ == "__main__":
    main()
