"""NGRAM against NGRAM with a datastore (REST where the n-grams match nothing), one engine at a
time: each engine made, timed over the prompts and shut down before the next (bench/spec.py
keeps every engine of a run in one process, which for a 1.5B model is most of this machine's
memory). Prints each one's seconds, the ratio, and the planner's record per kind of round
(`get_server_info()["speculative"]`): how many rounds the datastore drafted, their accept rate
by rank, and the plain steps they took the place of.

    python bench/rest_ab.py --model-path models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --datastore bench/out/stdlib-ds [--dataset humaneval] [--num-prompts 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import DATASETS  # noqa: E402
from bench.spec import chat  # noqa: E402
from spectral.engine import Engine  # noqa: E402


def timed(args, datastore: str | None) -> tuple[float, dict]:
    """Seconds over the prompts (greedy) and the planner's report."""
    engine = Engine(
        model_path=args.model_path,
        quantization=args.quantization,
        max_running_requests=1,
        speculative_algorithm="NGRAM",
        speculative_datastore=datastore,
    )
    try:
        prompts = [chat(engine.tokenizer, q) for q in DATASETS[args.dataset](args.num_prompts)]
        start = time.perf_counter()
        for prompt in prompts:
            engine.generate(prompt, {"max_new_tokens": args.max_new_tokens, "temperature": 0.0})
        return time.perf_counter() - start, engine.get_server_info()["speculative"]
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--datastore", required=True)
    ap.add_argument("--dataset", default="humaneval", choices=list(DATASETS))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    seconds = {}
    for name, datastore in (("NGRAM", None), ("NGRAM+REST", args.datastore)):
        seconds[name], info = timed(args, datastore)
        rounds = info["rounds"]
        print(
            f"{name:<11s} {seconds[name]:6.1f} s  rounds {rounds['rounds']}, plain steps "
            f"{rounds['plain_steps']}, speculative {rounds['measured_ms'] / 1e3:.1f} s, plain "
            f"{rounds['plain_measured_ms'] / 1e3:.1f} s"
        )
        for kind, stats in sorted(info["acceptance"].items()):
            if kind.startswith("rest:"):
                print(f"    {kind}: {stats['rounds']} rounds, by rank {stats['gain_by_rank'][:4]}")
    print(f"NGRAM+REST / NGRAM: {seconds['NGRAM'] / seconds['NGRAM+REST']:.3f}x")


if __name__ == "__main__":
    main()
