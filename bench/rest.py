"""REST's datastore: what building one costs, what a lookup costs against a decode step, and
what serving it adds to a process's memory.

1. Builds a datastore of the running Python's standard library (`Lib/`, its source and text
   files; installed packages are not entered) with
   the model's tokenizer (`spectral datastore build`), unless `--datastore` names one: build
   time, tokens, size on disk.
2. Lookups as the drafter makes them (REST alone: the longest suffix of up to 16 tokens, 32
   continuations merged into a trie) over the HumanEval prompts, each prompt at every 8th
   token: the median and p99 time, against a plain decode step of the model measured here
   (batch 1, the mean over `--step-tokens` tokens).
3. Memory: the process's anonymous and file-backed RSS before the datastore is opened and
   after every lookup (the server holds the datastore's sampled index and reads the rest
   through pread: its pages stay in the page cache, shared, and out of the process's RSS);
   `--synthetic-mib N` also builds a datastore of N MiB of random tokens and measures the
   same there.

Writes bench/out/rest.json.

    python bench/rest.py --model-path models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --quantization gguf-int8 [--synthetic-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import humaneval_prompts  # noqa: E402
from spectral.models.resolve import model_files_dir  # noqa: E402
from spectral.models.resolved import load_tokenizer  # noqa: E402
from spectral.speculative.sources.datastore import Datastore, build, write  # noqa: E402
from spectral.speculative.sources.ngram import NgramDrafter  # noqa: E402

OUT = Path(__file__).parent / "out"


def rss() -> dict[str, float]:
    """MiB of the process's anonymous and file-backed resident memory."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def lookups(store: Datastore, contexts: list[list[int]]) -> dict:
    """Time the REST drafter's proposal (the lookup and its trie) for every context."""
    drafter = NgramDrafter(max_nodes=7, max_depth=4, datastore=store, ngrams=False)
    times, matched = [], 0
    for context in contexts:
        start = time.perf_counter()
        tokens, _ = drafter.propose(context)
        times.append(time.perf_counter() - start)
        matched += bool(tokens)
    times.sort()
    return {
        "lookups": len(times),
        "with_a_draft": matched,
        "median_us": round(statistics.median(times) * 1e6, 1),
        "p99_us": round(times[int(0.99 * (len(times) - 1))] * 1e6, 1),
    }


def decode_step_s(args) -> float:
    """A plain decode step of the model at batch 1: the mean over `--step-tokens` tokens."""
    from spectral.engine import Engine

    engine = Engine(
        model_path=args.model_path, quantization=args.quantization, max_running_requests=1
    )
    params = {"max_new_tokens": args.step_tokens, "temperature": 0.0, "ignore_eos": True}
    engine.generate(["def f(x):"], {**params, "max_new_tokens": 4})  # warm
    start = time.perf_counter()
    engine.generate(["def fibonacci(n):"], params)
    seconds = (time.perf_counter() - start) / args.step_tokens
    engine.shutdown()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--datastore", default=None, help="an existing datastore (else built)")
    ap.add_argument("--output", default=str(OUT / "stdlib-ds"), help="where to build it")
    ap.add_argument("--step-tokens", type=int, default=32)
    ap.add_argument("--synthetic-mib", type=int, default=0)
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    tokenizer = load_tokenizer(model_files_dir(args.model_path))
    result: dict = {"model": args.model_path}
    path = args.datastore
    if path is None:
        stdlib = sysconfig.get_paths()["stdlib"]
        manifest = build(
            tokenizer, [stdlib], args.output, model=args.model_path, progress=sys.stderr.isatty()
        )
        path = args.output
        print(
            f"built {path} from {stdlib}: {manifest['tokens']:,} tokens, "
            f"{manifest['documents']:,} files, {manifest['bytes'] / 2**20:.1f} MiB, "
            f"{manifest['build_seconds']} s"
        )
    result["datastore"] = json.loads((Path(path) / "manifest.json").read_text())
    contexts = []
    for prompt in humaneval_prompts(164):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        contexts += [ids[:end] for end in range(8, len(ids) + 1, 8)]
    before = rss()
    store = Datastore(path)
    result["lookup"] = lookups(store, contexts)
    result["rss_mib"] = {"before": before, "after_lookups": rss()}
    print(f"stdlib: {result['lookup']}, RSS {result['rss_mib']}")
    if args.synthetic_mib:
        result["synthetic"] = synthetic(args.synthetic_mib, contexts, tokenizer)
    step = decode_step_s(args)
    result["decode_step_ms"] = round(step * 1e3, 2)
    result["lookup_over_step"] = round(result["lookup"]["median_us"] / 1e6 / step, 5)
    print(
        f"a decode step {step * 1e3:.1f} ms; a lookup (median) "
        f"{result['lookup']['median_us']:.0f} us = {100 * result['lookup_over_step']:.2f}% of it"
    )
    (OUT / "rest.json").write_text(json.dumps(result, indent=2) + "\n")


def synthetic(mib: int, contexts: list[list[int]], tokenizer) -> dict:
    """A datastore of `mib` MiB (int32 tokens and suffixes: 8 bytes a token) of the tokens of
    the contexts, shuffled in 64-token runs (so lookups match), and what serving it adds."""
    rng = np.random.default_rng(0)
    runs = [c[i : i + 64] for c in contexts for i in range(0, len(c), 64) if c[i : i + 64]]
    count = mib * 2**20 // 8
    docs, total = [], 0
    while total < count:
        doc = [t for k in rng.integers(0, len(runs), 256) for t in runs[k]]
        docs.append(doc)
        total += len(doc) + 1
    path = OUT / f"synthetic-{mib}mib-ds"
    start = time.perf_counter()
    write(path, docs, {"tokenizer": "synthetic"})
    built = time.perf_counter() - start
    before = rss()
    store = Datastore(path)
    found = lookups(store, contexts)
    after = rss()
    print(f"synthetic {mib} MiB ({total:,} tokens, written in {built:.0f} s): {found}")
    print(f"  RSS before {before}, after {after}")
    return {
        "mib": mib,
        "tokens": total,
        "write_s": round(built, 1),
        "lookup": found,
        "rss_mib": {"before": before, "after_lookups": after},
    }


if __name__ == "__main__":
    main()
