"""Speed on a CUDA GPU against what the GPU allows, in one run (issue 53's figures), on models of
bench/shapes.py's shapes with random weights made on the device (--load-format dummy):

- bandwidth: the device's read bandwidth (a reduction, and a copy counting read and write);
- decode_<shape>: plain greedy decoding's steady tokens/s at each batch size, and at batch 1 the
  fraction of the bandwidth bound (bandwidth / the model's weight bytes) it reaches;
- verify_8b: a 64-token tree's verify forward against a decode step (the start-up cost curve);
- spec_<shape>: an EAGLE-3 round (random head, fixed tree) against a plain step;
- profile, profile_1.5b, profile_8b: kernel launches and device time a decoded token, by kind
  of kernel (bench/gpu_profile.py);
- in_turn_1.5b: decode_1.5b's batches up to 16 with steps in turn (--disable-overlap-schedule),
  against decode_1.5b (steps launched ahead, the default on a GPU);
- peer_1.5b: HF transformers, static cache and torch.compile, on the same config and prompts.

The JSON (device, commit, driver, versions, figures, and `checks` against the targets) goes to
--out and, on a GPU, bench/results/gpu-latest.json, rewritten after every part: a part that
fails or runs out of --budget-s leaves its figures null and says why.

    python bench/gpu.py                                  # bf16, every part (~3 min on an H100)
    python bench/gpu.py --parts bandwidth,decode_8b      # some parts
    python bench/gpu.py --device cpu --shapes tiny --dtype float32   # the logic, on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_parts import (  # noqa: E402
    part_bandwidth,
    part_decode,
    part_in_turn,
    part_profile,
    part_spec,
    part_verify,
)
from bench.gpu_peer import part_peer  # noqa: E402
from bench.gpu_report import ROLES, derive  # noqa: E402
from bench.gpu_run import Bench  # noqa: E402
from bench.shapes import SHAPES  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu-latest.json"
PARTS: dict[str, tuple[Callable[[Bench], dict], float]] = {
    # name: (what it measures, the least seconds it needs on an H100); in the order they run
    "bandwidth": (part_bandwidth, 3),
    "decode_8b": (lambda b: part_decode(b, "8b"), 10),
    "decode_1.5b": (lambda b: part_decode(b, "1.5b"), 10),
    "decode_default": (lambda b: part_decode(b, "default"), 5),
    "verify_8b": (lambda b: part_verify(b, "8b"), 10),
    "spec_1.5b": (lambda b: part_spec(b, "1.5b"), 10),
    "spec_8b": (lambda b: part_spec(b, "8b"), 15),
    "profile": (lambda b: part_profile(b, "default"), 5),
    "profile_1.5b": (lambda b: part_profile(b, "1.5b"), 5),
    "profile_8b": (lambda b: part_profile(b, "8b"), 8),
    "in_turn_1.5b": (lambda b: part_in_turn(b, "1.5b"), 5),
    "peer_1.5b": (lambda b: part_peer(b, "1.5b"), 60),
}


def release() -> None:
    """Frees what the last part left (its engine or model, gone with its frame)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_parts(b: Bench, names: list[str]) -> None:
    """Runs the parts `names` in turn while --budget-s lasts, writing the report after each; a
    part that fails is recorded and the rest still run, an interrupt stops them all."""
    report = b.report
    for name in names:
        report.parts[name] = {"status": "pending"}
    report.write()
    for name in names:
        fn, need = PARTS[name]
        left = b.args.budget_s - report.elapsed()
        if left < need:
            report.parts[name] = {"status": "skipped", "reason": f"{left:.0f} s of budget left"}
            report.notes.append(
                f"{name}: skipped, {left:.0f} s of --budget-s left (needs ~{need} s)"
            )
            report.write()
            continue
        print(f"== {name} ({left:.0f} s of budget left)", flush=True)
        start = time.perf_counter()
        report.parts[name] = {"status": "running"}
        try:
            report.figures[name] = fn(b)
            report.parts[name] = {"status": "ok"}
        except KeyboardInterrupt:
            report.parts[name] = {"status": "interrupted"}
            report.failed.append({"part": name, "error": "interrupted (the run's time limit)"})
            for rest in names[names.index(name) + 1 :]:
                report.parts[rest] = {"status": "skipped", "reason": "interrupted"}
            report.write()
            raise
        except Exception as err:  # noqa: BLE001 - recorded; the other parts still run
            error = f"{type(err).__name__}: {err}"[:2000]
            print(f"{name} FAILED: {error}", flush=True)
            report.parts[name] = {"status": "failed"}
            report.failed.append({"part": name, "error": error})
        release()
        report.parts[name]["seconds"] = round(time.perf_counter() - start, 1)
        report.write()
        if name in report.figures:
            print(json.dumps(derive(report.figures, report.tau)[name])[:600], flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument(
        "--shapes",
        default="",
        help="bench/shapes.py shapes standing in for 8b, 1.5b and default: one name for all "
        "(tiny), or role=shape pairs (1.5b=tiny,8b=1.5b); default: each its own",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="auto", help="attention backend")
    ap.add_argument("--batches", default="1,16,64", help="decode_1.5b's batch sizes")
    ap.add_argument("--peer-batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--short-tokens", type=int, default=16, help="the run subtracted")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--verify-curves", type=int, default=3, help="verify_8b's measurements")
    ap.add_argument("--bandwidth-gib", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=330, help="no part starts after this")
    ap.add_argument("--tau", type=float, default=None, help="accept length for a projection")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu.json")
    ap.add_argument(
        "--results", type=Path, default=None, help=f"default on a GPU: {RESULTS.relative_to(ROOT)}"
    )
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    args.batches = sorted({1, *(int(n) for n in args.batches.split(",") if n)})
    args.peer_batches = [int(n) for n in args.peer_batches.split(",") if n]
    shapes = {role: role for role in ROLES}
    for item in [s for s in args.shapes.split(",") if s]:
        role, _, shape = item.rpartition("=")
        for r in [role] if role else ROLES:
            shapes[r] = shape
    bad = [s for s in shapes.values() if s not in SHAPES] + [r for r in shapes if r not in ROLES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; shapes are {', '.join(SHAPES)}, roles {ROLES}")
    args.shapes = shapes
    if not 0 < args.short_tokens < args.new_tokens:
        ap.error("need 0 < --short-tokens < --new-tokens")
    results = args.results or (RESULTS if args.device == "cuda" else None)
    args.write_to = [args.out] + ([results] if results else [])
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU; torch sees none (--device cpu runs the logic)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout still writes
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        if args.device == "cpu":
            bench.report.notes.append("a CPU run: the logic only, its figures mean nothing")
        try:
            run_parts(bench, args.parts)
        except KeyboardInterrupt:
            print("interrupted; the report so far is written", flush=True)
        bench.report.write()
    for check in bench.report.as_dict()["checks"]:
        value = "null" if check["value"] is None else f"{check['value']:.4g}"
        op, target, passed = check["op"], check["target"], check["passed"]
        print(f"{check['name']:26s} {value:>10s} {op} {target:<5} {passed}")
    print(f"wrote {', '.join(str(p) for p in args.write_to)}")
    if bench.report.failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
