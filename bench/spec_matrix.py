"""Speculation against plain decoding over the whole matrix: every dataset, batch size and
algorithm in one run (issue 55: speculation that never loses).

Each part is one `bench/spec.py` run in a process of its own (at each batch size at least four
batches' worth of prompts, `--min-batches`: batch 16 runs 64 prompts where `--num-prompts` says
8, so that the batch runs full, refilled from the queue as requests finish, and the last
requests' drain is a small part of a pass; `--passes` passes, 3 by default, over two plain
engines and every algorithm interleaved a scheduler step of each in turn, each engine kept
across the passes, every pass from a flushed cache, the algorithms' engines made in the order
given or reversed by turns of dataset and batch size (an engine's place among the process's
moves its speed by up to 4%); a cell is the median over the passes of its pass against the
faster of the two plain engines' in the same pass): the default model (float32
activations, so that outputs compare token for token; its weights on the path `--quantization`
names, by default auto's: the integer path on a CPU) on MT-Bench, HumanEval and code edits at
every batch size, with NGRAM, LOOKAHEAD, EAGLE3, EAGLE3+NGRAM and every source
(EAGLE3+NGRAM+LOOKAHEAD); then the 1.5B (its integer path) with NGRAM, LOOKAHEAD and STANDALONE
(the 0.5B drafting) at batches 1 and 4, where `python bench/models.py` has put both in models/.
A part whose JSON is already in bench/out is read, not run again (`--fresh` runs it anyway), so
an interrupted matrix resumes.

It prints every cell (speedup, and outputs identical to plain), whether every source is within
0.02 of the best single source at batch 1 on each dataset, the control's cells (PLAIN: plain
decoding timed as an algorithm), and the smallest algorithm's cell last; the heat-map goes to
bench/out/spec-matrix.png.

    python bench/spec_matrix.py                       # the whole matrix (hours on 2 cores)
    python bench/spec_matrix.py --quick               # 4 prompts, 48 tokens, batches 1 and 4
    python bench/spec_matrix.py --datasets humaneval --batches 1,16 --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from data import pyplot  # noqa: E402
from interleave import TURN_S  # noqa: E402
from models import KIT_DIR, MODELS  # noqa: E402

SINGLE = ["NGRAM", "LOOKAHEAD", "EAGLE3"]
# PLAIN: a second engine without speculation, timed as the algorithms are: the method's own
# reading where nothing differs (this machine's drift between runs)
DEFAULT_ALGORITHMS = ["PLAIN", *SINGLE, "EAGLE3+NGRAM", "EAGLE3+NGRAM+LOOKAHEAD"]
EVERY_SOURCE = "EAGLE3+NGRAM+LOOKAHEAD"
LARGE_ALGORITHMS = ["NGRAM", "LOOKAHEAD", "STANDALONE"]


def parts(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(output file name, bench/spec.py arguments) of each part of the matrix."""
    sizing = ["--max-new-tokens", str(args.max_new_tokens), "--passes", str(args.passes)]
    sizing += ["--min-batches", str(args.min_batches), "--turn-s", str(args.turn_s)]
    if args.num_prompts:
        sizing += ["--num-prompts", str(args.num_prompts)]
    out = []
    for index, dataset in enumerate(args.datasets.split(",")):
        out.append(
            (
                f"matrix-default-{dataset}.json",
                [
                    "--dataset", dataset, "--dtype", "float32", "--batches", args.batches,
                    "--quantization", args.quantization,
                    "--algorithms", ",".join(DEFAULT_ALGORITHMS), "--humaneval", "0", *sizing,
                    "--order-offset", str(index),  # early in some parts, late in others
                ],
            )
        )  # fmt: skip
    large, draft = (
        KIT_DIR / MODELS[m].file_name for m in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    )
    if args.large and large.exists() and draft.exists():
        for dataset in args.datasets.split(","):
            out.append(
                (
                    f"matrix-1.5b-{dataset}.json",
                    [
                        "--model-path", str(large), "--quantization", "gguf-int8",
                        "--dataset", dataset, "--batches", args.large_batches,
                        "--algorithms", ",".join(LARGE_ALGORITHMS), "--draft", str(draft),
                        "--humaneval", "0", *sizing,
                    ],
                )
            )  # fmt: skip
    elif args.large:
        print(f"the 1.5B part needs `python bench/models.py` ({', '.join(MODELS)}): skipped")
    return out


def run_part(name: str, spec_args: list[str], fresh: bool) -> dict:
    """The part's results, from bench/out if there and not `fresh`, else run now."""
    path = HERE / "out" / name
    if fresh or not path.exists():
        print(f"== {name}: bench/spec.py {' '.join(spec_args)}", flush=True)
        command = [sys.executable, str(HERE / "spec.py"), *spec_args, "--out", name]
        subprocess.run(command, check=True)
    else:
        print(f"== {name}: read from bench/out (--fresh runs it again)")
    return json.loads(path.read_text())


def cells(results: dict[str, dict]) -> list[dict]:
    """One row per (model, dataset, batch, algorithm): its speedup and identical outputs."""
    rows = []
    for name, result in results.items():
        model = name.split("-")[1]
        for run in result["runs"]:
            same, total = (int(x) for x in run["identical_outputs"].split("/"))
            rows.append(
                {
                    "model": model,
                    "dataset": result["dataset"],
                    "batch": run["batch"],
                    "algorithm": run["algorithm"],
                    "speedup": run["speedup"],
                    "identical": same == total,
                    "identical_outputs": run["identical_outputs"],
                }
            )
    return rows


def every_source_checks(rows: list[dict]) -> list[tuple[str, float, float, bool]]:
    """Per (model, dataset) at batch 1: (where, every source's speedup, the best single
    source's, whether every source is within 0.02 of it)."""
    out = []
    for model, dataset in sorted({(r["model"], r["dataset"]) for r in rows}):
        at1 = {
            r["algorithm"]: r["speedup"]
            for r in rows
            if (r["model"], r["dataset"], r["batch"]) == (model, dataset, 1)
        }
        singles = [at1[a] for a in SINGLE if a in at1]
        if EVERY_SOURCE in at1 and singles:
            every, best = at1[EVERY_SOURCE], max(singles)
            out.append((f"{model} {dataset}", every, best, every >= best - 0.02))
    return out


def heat_map(rows: list[dict], path: Path) -> None:
    """Speedups as colours: a row per model and algorithm, a column per dataset and batch."""
    plt = pyplot()
    if plt is None or not rows:
        return
    row_keys = sorted({(r["model"], r["algorithm"]) for r in rows})
    col_keys = sorted({(r["dataset"], r["batch"]) for r in rows})
    grid = [[float("nan")] * len(col_keys) for _ in row_keys]
    for r in rows:
        grid[row_keys.index((r["model"], r["algorithm"]))][
            col_keys.index((r["dataset"], r["batch"]))
        ] = r["speedup"]
    fig, ax = plt.subplots(figsize=(1.1 * len(col_keys) + 3, 0.45 * len(row_keys) + 1.5))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.6, aspect="auto")
    for i, line in enumerate(grid):
        for j, value in enumerate(line):
            if value == value:  # not NaN
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(col_keys)), [f"{d}\nbatch {b}" for d, b in col_keys], fontsize=8)
    ax.set_yticks(range(len(row_keys)), [f"{m} {a}" for m, a in row_keys], fontsize=8)
    ax.set_title("speedup over plain decoding (median of passes, each against the faster plain)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"heat-map: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--datasets", default="mtbench,humaneval,code-edit")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--large-batches", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=None, help="each dataset's (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-large", dest="large", action="store_false", help="the default model only")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 48 tokens, batches 1 and 4")
    ap.add_argument("--fresh", action="store_true", help="run every part, even those in bench/out")
    ap.add_argument(
        "--passes",
        type=int,
        default=3,
        help="interleaved passes over plain decoding and every algorithm (bench/spec.py); a "
        "cell is the median of its passes, each against the faster plain engine's pass",
    )
    ap.add_argument(
        "--min-batches",
        type=int,
        default=4,
        help="at each batch size at least this many batches' worth of prompts (batch 16: 64), "
        "so that a pass runs the batch full and its drain is short (bench/spec.py)",
    )
    ap.add_argument(
        "--turn-s",
        type=float,
        default=TURN_S,
        help="seconds of steps an engine runs in its turn (bench/interleave.py)",
    )
    ap.add_argument(
        "--quantization", default="auto", help="the default model's path (auto, gguf, gguf-int8)"
    )
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.batches = 4, 48, "1,4"
        args.large_batches = "1"
    results = {name: run_part(name, spec_args, args.fresh) for name, spec_args in parts(args)}
    rows = cells(results)
    print("\nmodel    dataset    batch  algorithm                 speedup  identical")
    for r in sorted(rows, key=lambda r: (r["model"], r["dataset"], r["batch"], r["algorithm"])):
        print(
            f"{r['model']:<8} {r['dataset']:<10} {r['batch']:5d}  {r['algorithm']:<24} "
            f"{r['speedup']:6.2f}x  {r['identical_outputs']}"
        )
    for where, every, best, ok in every_source_checks(rows):
        print(f"every source at batch 1, {where}: {every:.2f}x, best single {best:.2f}x: {ok}")
    (HERE / "out" / "spec-matrix.json").write_text(json.dumps(rows, indent=2) + "\n")
    heat_map(rows, HERE / "out" / "spec-matrix.png")
    control = [r["speedup"] for r in rows if r["algorithm"] == "PLAIN"]
    if control:
        print(
            f"the control (plain against plain, the same method): {min(control):.2f}x to "
            f"{max(control):.2f}x: cells within that band are this machine's drift"
        )
    spec = [r for r in rows if r["algorithm"] != "PLAIN"]
    if spec:
        low = min(spec, key=lambda r: r["speedup"])
        print(
            f"identical outputs in every cell: {all(r['identical'] for r in rows)}; "
            f"the smallest cell: {low['speedup']:.2f}x ({low['model']} {low['dataset']} "
            f"batch {low['batch']} {low['algorithm']})"
        )


if __name__ == "__main__":
    main()
