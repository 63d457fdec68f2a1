"""Shared-prefix workload (few-shot style): radix cache on vs off, same engine settings.

Every request is a long few-shot prompt (MT-Bench questions with short answers as examples)
followed by its own question; all requests are sent as one batch. Prints requests/s and
tokens/s with the cache on and off and their ratio; results go to bench/out/prefix.json.

    python bench/prefix.py --num-requests 64 --num-shots 12 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import mtbench_first_turns  # noqa: E402
from spectral import Engine  # noqa: E402


def few_shot_prompts(tokenizer, num_requests: int, num_shots: int) -> list[str]:
    questions = mtbench_first_turns()
    shots = questions[:num_shots]
    asks = questions[num_shots : num_shots + num_requests]
    messages = []
    for i, q in enumerate(shots):
        messages += [
            {"role": "user", "content": q},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    prompts = []
    for q in (asks * (num_requests // len(asks) + 1))[:num_requests]:
        prompts.append(
            tokenizer.apply_chat_template(
                messages + [{"role": "user", "content": q}],
                tokenize=False,
                add_generation_prompt=True,
            )
        )
    return prompts


def run(prompts: list[str], new_tokens: int, **engine_args) -> dict[str, float]:
    engine = Engine(**engine_args)
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(prompts[0][-200:], {**params, "max_new_tokens": 2})  # warm-up
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    info = engine.get_server_info()
    engine.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "seconds": round(elapsed, 2),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "prompt_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outs),
        "prefilled_tokens": info["stats"]["prefill_tokens"],
        "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-shots", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()

    common = dict(model_path=args.model_path, dtype=args.dtype, max_total_tokens=65536)
    probe = Engine(**common)
    prompts = few_shot_prompts(probe.tokenizer, args.num_requests, args.num_shots)
    probe.shutdown()
    on = run(prompts, args.max_new_tokens, **common)
    off = run(prompts, args.max_new_tokens, disable_radix_cache=True, **common)
    ratio = on["requests_per_s"] / off["requests_per_s"]
    print(
        f"{len(prompts)} requests, ~{on['prompt_tokens'] // len(prompts)} prompt tokens each, "
        f"{args.max_new_tokens} new tokens, {args.dtype}"
    )
    for name, r in (("radix cache on ", on), ("radix cache off", off)):
        print(
            f"{name}: {r['requests_per_s']:6.2f} req/s  {r['output_tokens_per_s']:7.1f} tok/s  "
            f"prefilled {r['prefilled_tokens']} tokens, cached {r['cached_tokens']}"
        )
    print(f"throughput ratio on/off: {ratio:.2f}x")
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "prefix.json").write_text(
        json.dumps({"on": on, "off": off, "ratio": round(ratio, 2)}, indent=2)
    )


if __name__ == "__main__":
    main()
