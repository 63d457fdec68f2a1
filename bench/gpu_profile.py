"""Where a decode step's time goes on the device: torch's profiler over plain greedy decoding of
one request on a model of a bench/shapes.py shape with random weights, per attention backend.
Prints the operators by host (self CPU) time, and per generated token the kernel launches (a
CUDA graph's replay is one), the kernels the device ran, how often the host waited on it, and
the device's time by kind of kernel (matmul, attention, norm, ...) with its longest kernels.
bench/gpu.py reports the same counts (`launches_per_token`).

    python bench/gpu_profile.py --backends triton,torch          # on a GPU
    python bench/gpu_profile.py --device cpu --shape tiny --backends torch --dtype float32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import make_model_dir  # noqa: E402
from spectral import Engine  # noqa: E402

# Host calls that start work on the device (a graph launch replays a whole captured step).
LAUNCHES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaLaunchCooperativeKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("cudaMemcpy", "cudaMemcpyAsync")


def _profiled(engine: Engine, prompt: list[int], tokens: int):
    """The profile of generating `tokens` greedily after `prompt` (and the decode steps run)."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and engine.args.resolved_device().startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
    before = engine.get_server_info()["stats"]["decode_steps"]
    with profile(activities=activities) as prof:
        engine.generate(input_ids=[prompt], sampling_params=params)
    return prof, engine.get_server_info()["stats"]["decode_steps"] - before


def _counts(prof) -> tuple[dict[str, float], dict[str, float]]:
    """Launch calls, graph launches, device kernels, host waits and copies, and the device's
    busy time (`device_ms`: its kernels' and copies' durations summed); and that time by
    kernel name (ms)."""
    counts = {
        "launches": 0,
        "graph_launches": 0,
        "device_kernels": 0,
        "syncs": 0,
        "copies": 0,
        "device_ms": 0.0,
    }
    by_kernel: dict[str, float] = {}
    for event in prof.events():
        name = event.name
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms = event.time_range.elapsed_us() / 1000
            counts["device_kernels"] += not name.startswith(("Memcpy", "Memset"))
            counts["device_ms"] += ms
            by_kernel[name] = by_kernel.get(name, 0.0) + ms
        elif name in LAUNCHES:
            counts["launches"] += 1
            counts["graph_launches"] += name == "cudaGraphLaunch"
        elif name in SYNCS:
            counts["syncs"] += 1
        elif name in COPIES:
            counts["copies"] += 1
    return counts, by_kernel


# What a kernel's name says it does (the first class whose words it holds, lower case), for
# the device time a token by class: where a step's time goes beside the bandwidth bound.
KERNEL_CLASSES = (
    ("norm", ("norm",)),  # before attention: FlashInfer's norms are named flashinfer::norm
    ("rotary", ("rope", "rotary")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "matmul", "splitk")),
    ("attention", ("attn", "attention", "flash", "decode", "prefill", "tree")),
    ("sampling", ("sampl", "argmax", "topk", "top_k", "softmax")),
    ("copy", ("memcpy", "memset", "copy", "cat")),
    ("elementwise", ("elementwise", "vectorized", "silu", "mul", "add")),
)
TOP_KERNELS = 12


def kernel_class(name: str) -> str:
    lower = name.lower()
    for cls, words in KERNEL_CLASSES:
        if any(w in lower for w in words):
            return cls
    return "other"


def device_breakdown(per_token_ms: dict[str, float]) -> dict[str, dict[str, float]]:
    """The device's microseconds a token by class, and its `TOP_KERNELS` longest kernels (names
    cut to 160 characters)."""
    classes: dict[str, float] = {}
    for name, ms in per_token_ms.items():
        cls = kernel_class(name)
        classes[cls] = classes.get(cls, 0.0) + ms
    top = sorted(per_token_ms.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {
        "device_us_by_class": {k: round(v * 1000, 1) for k, v in sorted(classes.items())},
        "top_kernels_us": {name[:160]: round(ms * 1000, 1) for name, ms in top},
    }


def launches_per_token(engine: Engine, prompt: list[int], short: int = 8, long: int = 40) -> dict:
    """Per decoded token of one request: host launch calls (graph launches among them), device
    kernels, host waits, copies and the device's busy milliseconds, from two profiled
    generations of `short` and `long` tokens (their difference: prefill and the first step
    cancel), and the device's time by kernel class and its longest kernels (empty without a
    GPU). Warms the engine up first."""
    engine.generate(input_ids=[prompt], sampling_params={"temperature": 0, "max_new_tokens": 4})
    short_prof, short_steps = _profiled(engine, prompt, short)
    long_prof, long_steps = _profiled(engine, prompt, long)
    steps = long_steps - short_steps
    (a, a_kernels), (b, b_kernels) = _counts(short_prof), _counts(long_prof)
    per_kernel = {
        name: (ms - a_kernels.get(name, 0.0)) / steps
        for name, ms in b_kernels.items()
        if ms > a_kernels.get(name, 0.0)
    }
    return {
        "decode_steps": steps,
        **{k: round((b[k] - a[k]) / steps, 3) for k in a},
        **device_breakdown(per_kernel),
    }


def profile_backend(model_dir: str, backend: str, args: argparse.Namespace) -> None:
    engine = Engine(
        model_path=model_dir,
        dtype=args.dtype,
        device=args.device,
        attention_backend=backend,
        load_format="dummy",
        max_total_tokens=8192,
    )
    prompt = [3 + (7 * i) % 1000 for i in range(args.prompt_len)]
    params = {"temperature": 0, "max_new_tokens": 4}
    engine.generate(input_ids=[prompt], sampling_params=params)
    prof, _ = _profiled(engine, prompt, args.tokens)
    print(f"== {backend}: {args.tokens} tokens after a {args.prompt_len}-token prompt")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print("per token, prefill included:")
    for key, count in _counts(prof)[0].items():
        print(f"  {key}: {count / args.tokens:.1f}")
    print("per decoded token (two runs' difference):", launches_per_token(engine, prompt))
    engine.shutdown()


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
