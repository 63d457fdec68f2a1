"""Tune the draft tree for a machine: tokens/s and τ of several (num_steps, topk,
num_draft_tokens) settings against plain decoding, on the same prompts in one run.

    python bench/spec_tune.py --batch 1 --num-prompts 8
    python bench/spec_tune.py --trees 4/1/5,5/4/8,6/4/12 --algorithm EAGLE3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import chat, mtbench_first_turns  # noqa: E402
from spec import measure  # noqa: E402
from spectral import Engine  # noqa: E402

TREES = "3/1/4,4/1/5,4/2/6,5/2/8,5/4/8,6/4/10,6/4/12,7/4/16"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--algorithm", default="EAGLE3")
    ap.add_argument("--draft", default="default")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--trees", default=TREES, help="steps/topk/tokens, comma-separated")
    ap.add_argument("--ngram-min-match", type=int, default=None, help="NGRAM shortest match")
    args = ap.parse_args()

    common = dict(
        model_path=args.model_path,
        dtype=args.dtype,
        max_total_tokens=32768,
        max_running_requests=args.batch,
    )
    questions = mtbench_first_turns(args.num_prompts)
    engine = Engine(**common)
    prompts = [chat(engine.tokenizer, q) for q in questions]
    plain, _, _ = measure(engine, prompts, args.max_new_tokens)
    engine.shutdown()
    print(f"batch {args.batch}  plain {plain:7.2f} tok/s")
    for tree in args.trees.split(","):
        steps, topk, tokens = (int(x) for x in tree.split("/"))
        engine = Engine(
            **common,
            speculative_algorithm=args.algorithm,
            speculative_draft_model_path=args.draft if args.algorithm != "NGRAM" else None,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=tokens,
            speculative_max_batch_size=args.batch,
            speculative_ngram_min_match_window_size=args.ngram_min_match,
        )
        speed, _, tau = measure(engine, prompts, args.max_new_tokens)
        engine.shutdown()
        print(
            f"steps {steps} topk {topk} tokens {tokens:2d}  {speed:7.2f} tok/s  "
            f"{speed / plain:5.2f}x  τ {tau:4.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
