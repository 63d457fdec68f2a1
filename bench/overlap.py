"""The overlap scheduler against steps in turn, through a server: the same MT-Bench prompts,
greedy, one request at a time and all at once, against a server launched with and without
`--enable-overlap-schedule` (its default on a GPU), in alternating passes; tokens/s, their
ratio, and whether the outputs are identical.

    python bench/overlap.py --num-prompts 8 --max-new-tokens 64 --passes 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from data import chat, mtbench_first_turns  # noqa: E402
from tests.server_utils import start_server, stop_server  # noqa: E402

MODES = {"in turn": [], "overlap": ["--enable-overlap-schedule"]}


def measure(url: str, texts: list[str], new_tokens: int, concurrency: int) -> tuple[float, list]:
    """Generated tokens/s over every prompt, `concurrency` at a time, and the outputs."""

    def one(text: str) -> list[int]:
        params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        body = {"text": text, "sampling_params": params}
        reply = httpx.post(url + "/generate", json=body, timeout=600)
        return reply.json()["output_ids"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(one, texts))
    elapsed = time.perf_counter() - start
    return sum(len(o) for o in outputs) / elapsed, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/out/overlap.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from spectral.models.resolve import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_path))
    texts = [chat(tokenizer, q) for q in mtbench_first_turns(args.num_prompts)]
    rates: dict[tuple[str, int], list[float]] = {}
    outputs: dict[str, list] = {}
    for p in range(args.passes):
        order = list(MODES) if p % 2 == 0 else list(reversed(MODES))
        for mode in order:
            proc, url = start_server(
                "--model-path", args.model_path, "--dtype", args.dtype, *MODES[mode]
            )
            try:
                measure(url, texts[:1], 8, 1)  # warm-up
                for concurrency in (1, len(texts)):
                    rate, outs = measure(url, texts, args.max_new_tokens, concurrency)
                    rates.setdefault((mode, concurrency), []).append(rate)
                    outputs.setdefault(mode, outs)
                info = httpx.get(url + "/get_server_info", timeout=30).json()
                print(f"pass {p} {mode}: decode steps ahead {info['stats']['decode_steps_ahead']}")
            finally:
                stop_server(proc)
    identical = outputs["in turn"] == outputs["overlap"]
    report = {"identical": identical, "rows": []}
    print(f"outputs identical: {identical}")
    for concurrency in (1, len(texts)):
        base = statistics.median(rates[("in turn", concurrency)])
        over = statistics.median(rates[("overlap", concurrency)])
        row = {"concurrency": concurrency, "in_turn_tok_s": round(base, 2),
               "overlap_tok_s": round(over, 2), "ratio": round(over / base, 3)}  # fmt: skip
        report["rows"].append(row)
        print(f"{concurrency} at a time: {base:.2f} -> {over:.2f} tok/s ({over / base:.3f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
