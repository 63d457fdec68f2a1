"""Serving benchmark: MT-Bench prompts over HTTP against a spectral server, beside the offline
Engine on the same prompts in the same run.

1. batch 1: requests one after another through the server (streamed, then not) and through
   the Engine, the best of two passes each (caches flushed before each); the server's overhead
   is 1 - server tok/s / engine tok/s.
2. a Poisson stream at --rate requests/s: throughput, time to first token and inter-token
   latency (p50, p99), streaming through /generate.

    python bench/serving.py --num-prompts 16 --max-new-tokens 64 --rate 1.0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from data import chat, mtbench_first_turns  # noqa: E402
from spectral import Engine  # noqa: E402
from tests.server_utils import start_server, stop_server  # noqa: E402

# Batch 1 runs each way this many times and the best counts: on a 2-core machine whose speed
# drifts, passes of the same work differed by 10-25% (an AMD EPYC, an evening's runs).
PASSES = 2


def greedy(new_tokens: int) -> dict:
    """The sampling parameters of every request here: greedy, `new_tokens` exactly."""
    return {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


async def stream_one(http: httpx.AsyncClient, url: str, text: str, new_tokens: int) -> dict:
    body = {
        "text": text,
        "stream": True,
        "sampling_params": greedy(new_tokens),
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with http.stream("POST", url + "/generate", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = len(json.loads(line[6:])["output_ids"])
            if got > tokens:
                stamps.append(time.perf_counter())
                tokens = got
    return {"start": start, "stamps": stamps, "tokens": tokens}


async def whole_one(http: httpx.AsyncClient, url: str, text: str, new_tokens: int) -> dict:
    """One request answered when it finishes (not streamed)."""
    body = {"text": text, "sampling_params": greedy(new_tokens)}
    reply = await http.post(url + "/generate", json=body)
    return {"tokens": reply.json()["meta_info"]["completion_tokens"]}


async def sequential(url: str, prompts: list[str], new_tokens: int, stream: bool = True) -> float:
    one = stream_one if stream else whole_one
    async with httpx.AsyncClient(timeout=600) as http:
        await one(http, url, prompts[0], 4)
        start, tokens = time.perf_counter(), 0
        for p in prompts:
            tokens += (await one(http, url, p, new_tokens))["tokens"]
    return tokens / (time.perf_counter() - start)


async def poisson(url: str, prompts: list[str], new_tokens: int, rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as http:
        tasks, begin = [], time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(stream_one(http, url, p, new_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    end = max(r["stamps"][-1] for r in results)
    ttft = [r["stamps"][0] - r["start"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    return {
        "throughput_tok_s": round(sum(r["tokens"] for r in results) / (end - begin), 2),
        "ttft_p50_s": round(percentile(ttft, 50), 3),
        "ttft_p99_s": round(percentile(ttft, 99), 3),
        "itl_p50_ms": round(1000 * percentile(itl, 50), 1),
        "itl_p99_ms": round(1000 * percentile(itl, 99), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="more server flags, e.g. '--worker-process'")
    args = ap.parse_args()

    new_tokens = args.max_new_tokens
    common = ["--model-path", args.model_path, "--dtype", args.dtype, "--max-total-tokens", "32768"]
    proc, url = start_server(*common, *args.server_args.split())
    try:
        from transformers import AutoTokenizer

        from spectral.models.resolve import resolve_model_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_path))
        prompts = [chat(tokenizer, q) for q in mtbench_first_turns(args.num_prompts)]
        server_seq, server_whole = 0.0, 0.0
        for _ in range(PASSES):  # the radix cache flushed before each pass
            httpx.post(url + "/flush_cache", timeout=60)
            server_seq = max(server_seq, asyncio.run(sequential(url, prompts, new_tokens)))
            httpx.post(url + "/flush_cache", timeout=60)
            whole = asyncio.run(sequential(url, prompts, new_tokens, stream=False))
            server_whole = max(server_whole, whole)
        httpx.post(url + "/flush_cache", timeout=60)
        stream = asyncio.run(poisson(url, prompts, args.max_new_tokens, args.rate, args.seed))
    finally:
        stop_server(proc)

    engine = Engine(model_path=args.model_path, dtype=args.dtype, max_total_tokens=32768)
    params = greedy(new_tokens)
    engine.generate(prompts[0], {**params, "max_new_tokens": 4})
    engine_seq = 0.0
    for _ in range(PASSES):
        engine.flush_cache()
        start, tokens = time.perf_counter(), 0
        for p in prompts:
            tokens += engine.generate(p, params)["meta_info"]["completion_tokens"]
        engine_seq = max(engine_seq, tokens / (time.perf_counter() - start))
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    engine_all = sum(o["meta_info"]["completion_tokens"] for o in outs) / (
        time.perf_counter() - start
    )
    engine.shutdown()

    overhead = 1 - server_seq / engine_seq
    print(f"{len(prompts)} MT-Bench prompts, {args.max_new_tokens} new tokens, {args.dtype}")
    print(
        f"batch 1   : server {server_seq:.2f} tok/s, engine {engine_seq:.2f} tok/s, "
        f"server overhead {100 * overhead:.1f}%"
    )
    print(
        f"batch 1, not streamed: server {server_whole:.2f} tok/s, "
        f"overhead {100 * (1 - server_whole / engine_seq):.1f}%"
    )
    st = stream
    print(
        f"poisson {args.rate}/s: {st['throughput_tok_s']} tok/s, "
        f"TTFT p50 {st['ttft_p50_s']} s p99 {st['ttft_p99_s']} s, "
        f"ITL p50 {st['itl_p50_ms']} ms p99 {st['itl_p99_ms']} ms"
    )
    print(f"engine, all prompts at once: {engine_all:.2f} tok/s")
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "serving.json").write_text(
        json.dumps(
            {
                "server_batch1_tok_s": round(server_seq, 2),
                "engine_batch1_tok_s": round(engine_seq, 2),
                "server_overhead": round(overhead, 4),
                "server_batch1_not_streamed_tok_s": round(server_whole, 2),
                "poisson": {"rate": args.rate, **stream},
                "engine_all_at_once_tok_s": round(engine_all, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
