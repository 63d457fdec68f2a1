"""Builds of the CPU kernels against each other, whole forwards in one process: each build
(this checkout's sources, or another checkout's, with extra -D flags) serves its own
ModelWorker over the same model, and their forwards alternate --reps times (5 calls a turn):
decode steps of one request (M = 1) and verify forwards of M tokens over a --prefix-token
prefix, on the integer path as `--quantization auto` serves a GGUF on a CPU.

Where an engine sits in memory moves a forward by a few percent (a second build of identical
code read 0.949x the first at M = 1), so a control build of this checkout runs beside the
first: read each build against the control, not against the first.

    python bench/kernel_ab.py --builds "old@../other-checkout,none:SPECTRAL_PREFETCH_AHEAD=0"
        [--model-path default | --model qwen2.5-coder-1.5b] [--ms 1,4,8] [--reps 11]

Prints, per shape, each build's median ms and its ratio to the control.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import spectral.worker.model_worker as model_worker  # noqa: E402
from bench.cost_curve import Shapes  # noqa: E402
from bench.models import model_file  # noqa: E402
from spectral.kernels.cpu_kernels import compile_kernels, load_cpu_kernels  # noqa: E402
from spectral.models.resolve import gguf_source, model_files_dir  # noqa: E402

BUILD_DIR = ROOT / "bench" / "out" / "kernel_ab"
CALLS_A_TURN = 5


def build(name: str, source: Path, defines: list[str]):
    """The kernels of `source`'s checkout compiled as the runtime's native build, plus -D
    `defines`, under a module name of their own."""
    directory = BUILD_DIR / name
    directory.mkdir(parents=True, exist_ok=True)
    module = source / "spectral" / "kernels" / "cpu" / "module.cpp"
    name = f"spectral_cpu_kernels_ab_{name}"
    return compile_kernels(name, "native", directory, module, tuple(defines))


def parse_builds(spec: str) -> list[tuple[str, Path, list[str]]]:
    """`name[:DEFINE;DEFINE...][@checkout]`, comma-separated."""
    out = []
    for item in filter(None, spec.split(",")):
        item, _, source = item.partition("@")
        name, _, defines = item.partition(":")
        out.append((name, Path(source) if source else ROOT, [d for d in defines.split(";") if d]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", required=True, help="name[:DEFINES][@checkout], comma-separated")
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--model", default=None, help="a kit model (bench/models.py); overrides it")
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--reps", type=int, default=11)
    ns = ap.parse_args()
    path = str(model_file(ns.model)) if ns.model else ns.model_path
    ms = [int(m) for m in ns.ms.split(",")]
    modules = {"first": load_cpu_kernels()}
    modules["control"] = build("control", ROOT, [])
    for name, source, defines in parse_builds(ns.builds):
        modules[name] = build(name, source, defines)
    workers = {}
    for name, module in modules.items():
        model_worker.load_cpu_kernels = lambda module=module: module
        worker = model_worker.ModelWorker(
            model_files_dir(path),
            dtype=torch.float32,
            device="cpu",
            max_total_tokens=(ns.prefix + 1) * (max(ms) + 1) + 2 * max(ms),
            max_running_requests=max(ms) + 1,
            max_context_len=ns.prefix + max(ms) + 1,
            use_cpu_kernels=True,
            gguf_file=str(gguf_source(path)),
            gguf_native=True,
            gguf_int8=True,
        )
        workers[name] = (worker, Shapes(worker, ns.prefix, max(ms)))
    for m in ms:
        times: dict[str, list[float]] = {name: [] for name in workers}
        for _ in range(ns.reps):
            for name, (worker, shapes) in workers.items():
                batch = shapes.verify(m) if m > 1 else shapes.decode(1)
                worker.forward_logits(batch)
                began = time.perf_counter()
                for _ in range(CALLS_A_TURN):
                    worker.forward_logits(batch)
                times[name].append((time.perf_counter() - began) / CALLS_A_TURN * 1000)
        median = {name: statistics.median(t) for name, t in times.items()}
        shape = "verify" if m > 1 else "decode"
        cells = ", ".join(
            f"{name} {ms_:.2f} ms ({ms_ / median['control']:.3f})" for name, ms_ in median.items()
        )
        print(f"{shape} M={m}: {cells}", flush=True)


if __name__ == "__main__":
    main()
