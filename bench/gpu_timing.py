"""How bench/gpu.py's parts time things: a device operation's best time, an engine's steady
decode step, and the random prompts they feed it."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from spectral import Engine


def random_prompts(vocab_size: int, count: int, length: int) -> list[list[int]]:
    """Prompts of `length` random token ids (past bench/shapes.py's special tokens)."""
    rng = random.Random(count)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def best_seconds(fn: Callable[[], object], device: str, repeats: int = 10) -> float:
    """The fastest of `repeats` calls of `fn` after two warm-ups (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return min(times)


def graph_info(engine: Engine) -> dict:
    """What the engine reports of its CUDA graphs (buckets, capture seconds, memory)."""
    return {k: v for k, v in engine.get_server_info().items() if "graph" in k}


def steady_decode(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Steady-state greedy decoding of `prompts` at once, ignoring EOS: a step is the time
    between the best of --repeats generations of --short-tokens and of --new-tokens over their
    difference in decode steps (prefill and the first step cancel). A speculative engine's
    steps are its rounds."""

    def run(tokens: int) -> tuple[float, dict]:
        params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
        before = engine.get_server_info()["stats"]
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        after = engine.get_server_info()["stats"]
        short = [len(o["output_ids"]) for o in outs if len(o["output_ids"]) != tokens]
        if short:
            raise RuntimeError(f"requests ended early: {short} of {tokens} tokens (see the log)")
        return seconds, {k: after[k] - before[k] for k in after}

    run(args.short_tokens)  # warm-up: first-use kernels, graphs, JIT builds
    best: dict[int, tuple[float, dict]] = {}
    for _ in range(args.repeats):
        for tokens in (args.short_tokens, args.new_tokens):
            got = run(tokens)
            if tokens not in best or got[0] < best[tokens][0]:
                best[tokens] = got
    (t0, s0), (t1, s1) = best[args.short_tokens], best[args.new_tokens]
    steps = s1["decode_steps"] - s0["decode_steps"]
    step_s = (t1 - t0) / steps
    if step_s <= 0:
        raise RuntimeError(
            f"{args.new_tokens} tokens took no longer than {args.short_tokens} ({t1:.3f} s "
            f"against {t0:.3f} s): timing noise; raise --new-tokens or --repeats"
        )
    rounds = s1["spec_verify_ct"]
    return {
        "step_ms": round(1000 * step_s, 4),
        "tok_s": round(len(prompts) / step_s, 1),
        "e2e_tok_s": round(len(prompts) * args.new_tokens / t1, 1),  # prefill included
        "e2e_s": round(t1, 4),
        "decode_steps": s1["decode_steps"],
        "spec_rounds": rounds,
        "accept_length": round(s1["spec_emitted_tokens"] / rounds, 3) if rounds else None,
    }
