"""Speculative decoding speed: the same prompts with and without speculation, in one run.

MT-Bench first turns (all 80, or `--quick` for the first 16; `--dataset humaneval`: HumanEval
problems; `--dataset code-edit`: a HumanEval function and an instruction to change it), greedy
or at `--temperature`, with the model's chat template; for each batch size (requests in flight
at once) it prints tokens/s without speculation and with each algorithm while the batch is
full (until the queue is empty and a request finishes; the whole pass's beside it), in
`--passes` passes (each over every engine in turns of steps, bench/interleave.py: engines kept
across passes, each pass from a flushed cache); each pass is taken against plain decoding's
(with the control PLAIN, against the faster of the two plain engines) and a speedup is the
median over the passes (the plain passes' spread is printed). For each algorithm: tokens/s,
the average accept length τ (tokens per speculative round and request), and how many outputs
equal the plain ones (bf16 multi-token forwards round differently from one-token ones, so a
few may differ; float32 output is identical, which the tests check). HumanEval prompts give
a second τ for the drafter. Results also go to bench/out/spec.json.

    python bench/spec.py --quick
    python bench/spec.py --algorithms EAGLE3 --draft default --batches 1
    python bench/spec.py --dtype bfloat16 --quantization none   # bf16, dequantized at load
    python bench/spec.py --batches 1 --temperature 0.7
    python bench/spec.py --model-path models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --quantization gguf-int8 --dataset humaneval --algorithms STANDALONE,NGRAM \
        --draft models/qwen2.5-coder-0.5b-instruct.gguf   # a draft model (bench/models.py)
    # the same draft drafting from a hot-token map (+MAP) of the Python standard library:
    spectral token-map --model models/qwen2.5-coder-0.5b-instruct.gguf \
        --output bench/out/stdlib-map.json "$(python -c 'import sysconfig as s;
print(s.get_paths()["stdlib"])')"
    python bench/spec.py ... --algorithms STANDALONE,STANDALONE+MAP \
        --token-map bench/out/stdlib-map.json
    # +Q4: the draft's layers quantized again to 4 bits at load (--speculative-draft-quantization)
    # Medusa heads (spectral train-medusa writes them), beside NGRAM:
    python bench/spec.py --batches 1 --algorithms MEDUSA,NGRAM --medusa models/medusa-smollm2-135m
    # REST: a datastore of the standard library (bench/rest.py builds it), alone and with NGRAM:
    python bench/spec.py ... --algorithms NGRAM,REST,NGRAM+REST --datastore bench/out/stdlib-ds

Trees are sized per round by the tree planner from the measured cost model (`--fixed-tree`:
every round the full tree); each row also prints the tree nodes verified per request and round
and the planner's predicted against measured gain over plain decoding.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import DATASETS, chat, humaneval_prompts, pyplot  # noqa: E402
from interleave import TURN_S, generate, interleaved_pass, sampling, spec_counts  # noqa: E402
from spectral import Engine  # noqa: E402


def timed_generate(
    engine: Engine,
    prompts: list[str] | list[list[int]],
    params: dict | list[dict],
    during: AbstractContextManager | None = None,
) -> tuple[list[dict], float, float]:
    """(outputs, seconds, τ) of generating all prompts at once (the engine's
    max_running_requests at a time), after a warm-up on the first prompt and with an empty
    cache; `during` is entered around the timed part only. τ = 0 without speculation."""
    first = params[0] if isinstance(params, list) else params
    generate(engine, prompts[:1], {**first, "max_new_tokens": 8})  # warm-up
    engine.flush_cache()
    rounds, emitted = spec_counts(engine)
    with during or contextlib.nullcontext():
        start = time.perf_counter()
        outs = generate(engine, prompts, params)
        elapsed = time.perf_counter() - start
    rounds_after, emitted_after = spec_counts(engine)
    rounds = rounds_after - rounds
    return outs, elapsed, (emitted_after - emitted) / rounds if rounds else 0.0


def measure(
    engine: Engine, prompts: list[str] | list[list[int]], new_tokens: int, temperature: float = 0.0
) -> tuple[float, list, float]:
    """(tokens/s, outputs, τ) for generating all prompts greedily or at `temperature`."""
    outs, elapsed, tau = timed_generate(engine, prompts, sampling(temperature, new_tokens))
    tokens = sum(len(o["output_ids"]) for o in outs)
    return tokens / elapsed, [o["output_ids"] for o in outs], tau


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument(
        "--quantization",
        default="auto",
        help="auto: as the server resolves it (a GGUF on a CPU: gguf-int8); gguf: a GGUF "
        "model's blocks, exact; none: dequantized",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="every prompt prefilled whole in every run (the outputs then compare bit for bit "
        "under gguf-int8, whose prefill attention depends on how a prompt was split)",
    )
    ap.add_argument(
        "--fixed-tree", action="store_true", help="every round the full tree (no planner)"
    )
    ap.add_argument("--quick", action="store_true", help="the first 16 MT-Bench questions")
    ap.add_argument(
        "--dataset",
        default="mtbench",
        choices=list(DATASETS),
        help="the prompts timed: MT-Bench first turns, HumanEval problems, or code edits "
        "(a HumanEval function and an instruction to change it: bench/data.py)",
    )
    ap.add_argument("--num-prompts", type=int, default=None, help="overrides --quick")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument(
        "--algorithms",
        default="EAGLE3+NGRAM,EAGLE3,NGRAM",
        help="PLAIN: a second engine without speculation, timed as the algorithms are (a "
        "control); EAGLE3+NGRAM: the head, with n-gram trees where they match (hybrid); "
        "EAGLE3+NGRAM+MERGE: the n-gram tree joins the head's there; EAGLE3+NGRAM+LOOKAHEAD: "
        "every source, LOOKAHEAD's window and pool with the n-gram trees; +MIX (any, PLAIN "
        "too): prefill steps decode the running requests (--enable-mixed-chunk)",
    )
    ap.add_argument("--draft", default="default", help="EAGLE3 head directory")
    ap.add_argument(
        "--medusa", default=None, help="MEDUSA: a Medusa head directory (spectral train-medusa)"
    )
    ap.add_argument(
        "--token-map",
        default=None,
        help="STANDALONE+MAP: the draft's hot-token map (`spectral token-map` writes one)",
    )
    ap.add_argument("--hybrid-ngram", type=int, default=8, help="EAGLE3+NGRAM: n-gram tree size")
    ap.add_argument(
        "--datastore",
        default=None,
        help="REST (alone) and NAME+REST: a datastore (`spectral datastore build`) drafting "
        "where the n-grams match nothing",
    )
    ap.add_argument("--ngram-min-match", type=int, default=None)
    ap.add_argument("--num-steps", type=int, default=None)
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--max-batch-size", type=int, default=None, help="speculate up to this")
    ap.add_argument("--humaneval", type=int, default=16, help="HumanEval prompts for τ (0: none)")
    ap.add_argument(
        "--order-offset",
        type=int,
        default=0,
        help="the algorithms' engines are made in the order given at the first batch size, "
        "reversed at the next, and so on; 1 starts reversed",
    )
    ap.add_argument(
        "--llama-modes",
        default="",
        help="at batch 1, llama.cpp on the same prompts (make bench-peers): 'plain' "
        "(llama-cpp-python) and llama-speculative-simple's --spec-type modes, e.g. "
        "plain,ngram-simple,ngram-mod,draft-simple (drafting from --draft); each algorithm is "
        "also given against the fastest",
    )
    ap.add_argument(
        "--passes",
        type=int,
        default=1,
        help="passes over plain decoding and every algorithm, interleaved step by step; "
        "each speedup the median over the passes",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="prompts given to the engines at a time (default: all of a pass's, the batch "
        "refilled from the queue as requests finish, as a server's is)",
    )
    ap.add_argument(
        "--min-batches",
        type=int,
        default=1,
        help="at each batch size at least this many batches' worth of prompts (the dataset's "
        "first N x batch where --num-prompts gives fewer), so that a pass runs the batch full",
    )
    ap.add_argument(
        "--turn-s",
        type=float,
        default=TURN_S,
        help="seconds of scheduler steps an engine runs in its turn (bench/interleave.py)",
    )
    ap.add_argument("--out", default="spec.json", help="file name under bench/out")
    args = ap.parse_args()

    count = args.num_prompts or (16 if args.quick else None)
    questions = DATASETS[args.dataset](count)
    results: dict[str, object] = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "temperature": args.temperature,
        "fixed_tree": args.fixed_tree,
        "disable_radix_cache": args.disable_radix_cache,
        "dataset": args.dataset,
        "num_prompts": len(questions),
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "runs": [],
    }
    common = dict(
        model_path=args.model_path,
        dtype=args.dtype,
        quantization=args.quantization,
        disable_radix_cache=args.disable_radix_cache,
    )
    spec_options = dict(
        speculative_num_steps=args.num_steps,
        speculative_eagle_topk=args.topk,
        speculative_num_draft_tokens=args.num_draft_tokens,
        speculative_max_batch_size=args.max_batch_size,
        speculative_ngram_min_match_window_size=args.ngram_min_match,
        speculative_fixed_tree=args.fixed_tree,
    )
    algorithms = [a for a in args.algorithms.split(",") if a]
    for index, size in enumerate(int(b) for b in args.batches.split(",") if b):
        wanted = args.min_batches * size
        sized = questions if len(questions) >= wanted else DATASETS[args.dataset](wanted)
        # engines made in the order given and reversed at every other batch size: where an
        # engine sits among the process's engines moves its speed by up to 4% (a machine's
        # memory; docs/benchmarks.md, 2026-12-02), which no algorithm should always carry
        order = algorithms if (index + args.order_offset) % 2 == 0 else algorithms[::-1]
        rows, prompts = run_size(args, size, order, sized, common, spec_options)
        if size == 1 and args.llama_modes:
            llama = llama_runs(args, prompts)
            if llama:
                best_mode, best = max(llama.items(), key=lambda item: item[1])
                results["llama_cpp_tok_s"] = llama
                for row in rows:
                    row["over_llama_best"] = round(row["spec_tok_s"] / best, 3)
                    print(
                        f"batch {size:3d}  {row['algorithm']:<18s} "
                        f"{row['over_llama_best']:5.2f}x llama.cpp's fastest"
                    )
                print(f"batch   1  llama.cpp          {llama}; the fastest {best_mode} {best:.2f}")
        results["runs"].extend(rows)
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / args.out).write_text(json.dumps(results, indent=2) + "\n")
    plot(results["runs"], out_dir / Path(args.out).with_suffix(".png").name, args.dataset)


def spec_engine(args, common: dict, spec_options: dict, size: int, algo: str) -> Engine:
    """An engine serving `algo` (NAME[+EXTRA...], see --algorithms) at batch `size`; PLAIN:
    one without speculation, timed as the algorithms are (a control: its cell is what the
    method gives where nothing differs)."""
    name, *extras = algo.split("+")
    sizing = dict(
        max_running_requests=size,
        max_total_tokens=kv_tokens(size),
        enable_mixed_chunk="MIX" in extras,
    )
    if name == "PLAIN":
        return Engine(**common, **sizing)
    return Engine(
        **common,
        **sizing,
        speculative_algorithm=name,
        speculative_draft_model_path=(
            None
            if name in ("NGRAM", "LOOKAHEAD", "REST")
            else args.medusa
            if name == "MEDUSA"
            else args.draft
        ),
        speculative_hybrid_ngram=args.hybrid_ngram if "NGRAM" in extras else 0,
        speculative_hybrid_merge="MERGE" in extras,
        speculative_hybrid_lookahead="LOOKAHEAD" in extras,
        speculative_token_map=args.token_map if "MAP" in extras else None,
        speculative_draft_quantization="q4_1" if "Q4" in extras else "auto",
        speculative_datastore=args.datastore if "REST" in (name, *extras) else None,
        **spec_options,
    )


def kv_tokens(size: int) -> int:
    """An engine's KV pool at batch `size`: 2048 tokens a request (a prompt here and its new
    tokens, with room for the radix cache), 16384 at least, 65536 at most: the matrix's seven
    engines of the default model in float32 at 65536 each (3 GiB) held 22.5 of 24 GiB."""
    return min(65536, max(16384, 2048 * size))


def faster_plain(timings: dict, rate: str) -> float:
    """A pass's plain speed (`rate`: a PassTiming property): the faster of the plain engine
    and the control PLAIN where it ran."""
    return max(getattr(timings[name], rate) for name in ("plain", "PLAIN") if name in timings)


def against_plain(algo: str, timings: dict, rate: str) -> float:
    """`algo`'s speed in a pass over plain decoding's (the control PLAIN: over the plain
    engine's alone)."""
    plain = getattr(timings["plain"], rate) if algo == "PLAIN" else faster_plain(timings, rate)
    return getattr(timings[algo], rate) / plain


def run_size(
    args, size: int, algorithms: list[str], questions, common: dict, spec_options: dict
) -> tuple[list[dict], list[str]]:
    """Every algorithm against plain decoding at batch `size`: `--passes` passes, each over
    every engine interleaved step by step (bench/interleave.py), every engine kept across the
    passes and flushed at each pass's start. An algorithm's pass is taken against plain
    decoding's in the same pass, or, with the control PLAIN among the algorithms (a second
    engine without speculation), against the faster of the two; its speedup is the median over
    the passes. Returns (rows, prompts)."""
    temp = args.temperature
    plain_engine = spec_engine(args, common, spec_options, size, "PLAIN")
    prompts = [chat(plain_engine.tokenizer, q) for q in questions]
    engines = {"plain": plain_engine}
    engines.update((a, spec_engine(args, common, spec_options, size, a)) for a in algorithms)
    params = sampling(temp, args.max_new_tokens)
    chunk = args.chunk or len(prompts)
    passes = []
    for p in range(args.passes):
        timings = interleaved_pass(
            engines, prompts, params, chunk, reverse=p % 2 == 1, turn_s=args.turn_s
        )
        passes.append(timings)
        plain = timings["plain"]
        print(f"batch {size:3d}  plain              {plain.tok_s:7.2f} tok/s  (pass {p + 1})")
        for algo in algorithms:
            run = timings[algo]
            same = sum(a == b for a, b in zip(run.outputs, plain.outputs))
            print(
                f"batch {size:3d}  {algo:<18s} {run.tok_s:7.2f} tok/s  "
                f"{run.tok_s / plain.tok_s:5.2f}x τ {run.accept_length:4.2f}  "
                f"identical {same}/{len(prompts)}  (pass {p + 1})"
            )
    plain_out = passes[0]["plain"].outputs
    plain_runs = [t["plain"].tok_s for t in passes]
    baseline = [faster_plain(t, "tok_s") for t in passes]
    rows = []
    for algo in algorithms:
        engine = engines.pop(algo)
        runs = [t[algo] for t in passes]
        ratios = [against_plain(algo, t, "tok_s") for t in passes]
        whole = [against_plain(algo, t, "whole_tok_s") for t in passes]
        same = min(sum(a == b for a, b in zip(run.outputs, plain_out)) for run in runs)
        planned = engine.get_server_info().get("speculative", {}).get("rounds", {})
        row = {
            "batch": size,
            "algorithm": algo,
            "plain_tok_s": round(max(baseline), 2),
            "plain_tok_s_runs": [round(x, 2) for x in plain_runs],
            "spec_tok_s": round(statistics.median(run.tok_s for run in runs), 2),
            "speedup": round(statistics.median(ratios), 3),
            "speedups": [round(x, 3) for x in ratios],
            # the whole pass, the last requests' drain at smaller batches included
            "speedup_whole_pass": round(statistics.median(whole), 3),
            "accept_length": round(statistics.median(run.accept_length for run in runs), 3),
            "identical_outputs": f"{same}/{len(prompts)}",
            "prompts": len(prompts),
            "tree_nodes_per_request": planned.get("tree_nodes_per_request"),
            "predicted_gain": planned.get("predicted_gain"),
            "measured_gain": planned.get("measured_gain"),
        }
        name = algo.split("+")[0]
        if name not in ("NGRAM", "LOOKAHEAD", "REST") and size == 1 and args.humaneval:
            code = [chat(engine.tokenizer, p) for p in humaneval_prompts(args.humaneval)]
            _, _, row["humaneval_accept_length"] = measure(engine, code, args.max_new_tokens, temp)
        engine.shutdown()
        gc.collect()
        rows.append(row)
        extra = (
            f", HumanEval τ {row['humaneval_accept_length']:.2f}"
            if "humaneval_accept_length" in row
            else ""
        )
        if row["tree_nodes_per_request"] is not None:
            extra += (
                f", {row['tree_nodes_per_request']:.1f} nodes/round, gain predicted "
                f"{row['predicted_gain']:.2f} measured {row['measured_gain']:.2f}"
            )
        print(
            f"batch {size:3d}  {algo:<18s} {row['speedup']:5.2f}x (median of "
            f"{', '.join(f'{x:.2f}' for x in ratios)}; the whole pass "
            f"{row['speedup_whole_pass']:.2f}x)  τ {row['accept_length']:4.2f}  "
            f"identical {row['identical_outputs']}{extra}"
        )
    plain_engine.shutdown()
    drift = max(plain_runs) / min(plain_runs) - 1
    listed = ", ".join(f"{x:.2f}" for x in plain_runs)
    print(f"batch {size:3d}  plain passes {listed} tok/s (spread {drift:.1%})")
    return rows, prompts


def llama_runs(args, prompts: list[str]) -> dict[str, float]:
    """tok/s of each of --llama-modes over `prompts` at batch 1, given as the same token ids
    (peers.py's runs; a mode that is not installed or fails is left out, saying so)."""
    from peers import llama_job, llama_mode
    from spectral.models.resolve import gguf_source, model_files_dir
    from spectral.models.resolved import load_tokenizer

    tokenizer = load_tokenizer(model_files_dir(args.model_path))
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in prompts]
    job = llama_job(ids, prompts, str(gguf_source(args.model_path) or ""), args.max_new_tokens)
    speeds = {}
    for mode in [m for m in args.llama_modes.split(",") if m]:
        result = llama_mode(mode, job, args.draft, timeout=3600)
        if result is not None:
            speeds[mode] = round(result["batch1_tok_s"], 2)
    return speeds


def plot(rows: list[dict], path: Path, dataset: str) -> None:
    """Speedup over plain decoding per algorithm (bars) at each batch size, τ on each bar."""
    plt = pyplot()
    if plt is None:
        return
    if not rows:
        return
    sizes = sorted({r["batch"] for r in rows})
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    width = 0.8 / len(algorithms)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(sizes) * len(algorithms) ** 0.5, 3.6))
    for i, algo in enumerate(algorithms):
        for j, size in enumerate(sizes):
            row = next((r for r in rows if r["batch"] == size and r["algorithm"] == algo), None)
            if row is None:
                continue
            x = j + (i - (len(algorithms) - 1) / 2) * width
            ax.bar(x, row["speedup"], width, color=f"C{i}", label=algo if j == 0 else None)
            ax.text(
                x,
                row["speedup"],
                f"τ{row['accept_length']:.1f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(sizes)), [f"batch {s}" for s in sizes])
    ax.set_ylabel("speedup over plain")
    ax.set_title(f"speculative decoding, {dataset}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
