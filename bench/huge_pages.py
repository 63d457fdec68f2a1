"""Decoding with large CPU tensors on transparent huge pages against 4 KiB pages (spectral's
default sets THP_MEM_ALLOC_ENABLE=1; 0 keeps 4 KiB pages): each setting in processes of its own,
alternated, the same prompts (MT-Bench, greedy) at one batch size. Prints each run's tok/s, the
huge pages the process held, and the median ratio.

    python bench/huge_pages.py                         # the default model, batch 1
    python bench/huge_pages.py --model-path models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --num-prompts 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One run, in its own process (spectral imported first: the allocator reads the setting then).
RUN = """
import json, statistics, sys, time
sys.path.insert(0, {root!r})
from spectral.engine import Engine
from bench.data import DATASETS, chat
engine = Engine(model_path={model!r}, dtype="float32", max_running_requests={batch},
                max_total_tokens=16384)
prompts = [chat(engine.tokenizer, q) for q in DATASETS["mtbench"]({prompts})]
params = {{"temperature": 0.0, "max_new_tokens": {tokens}}}
engine.generate(prompts[0], {{**params, "max_new_tokens": 8}})
rates = []
for _ in range(2):
    engine.flush_cache()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    rates.append(sum(len(o["output_ids"]) for o in outputs) / (time.perf_counter() - start))
huge = open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0]
print(json.dumps({{"tok_s": statistics.median(rates), "huge_mib": int(huge) // 1024}}))
engine.shutdown()
"""


def run(args: argparse.Namespace, huge: bool) -> dict:
    code = RUN.format(
        root=str(ROOT),
        model=args.model_path,
        batch=args.batch,
        prompts=args.num_prompts,
        tokens=args.max_new_tokens,
    )
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1" if huge else "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    ratios = []
    for r in range(args.rounds):
        results = {}
        for huge in (True, False) if r % 2 == 0 else (False, True):
            results[huge] = run(args, huge)
            print(
                f"round {r + 1}  {'huge pages' if huge else '4 KiB pages':<11s} "
                f"{results[huge]['tok_s']:7.2f} tok/s  ({results[huge]['huge_mib']} MiB on huge "
                "pages)",
                flush=True,
            )
        ratios.append(results[True]["tok_s"] / results[False]["tok_s"])
    print(
        f"huge pages against 4 KiB pages: {statistics.median(ratios):.3f}x (median of "
        f"{', '.join(f'{x:.3f}' for x in ratios)})"
    )


if __name__ == "__main__":
    main()
