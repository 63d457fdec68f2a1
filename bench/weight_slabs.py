"""Decoding with a model's weights gathered into slabs on huge pages (spectral/mem/weights.py,
the default) against the weights where loading left them, in one process: engines of each kind
made alternately and timed in interleaved passes (bench/interleave.py) on the same prompts
(MT-Bench, greedy). Prints each engine's tok/s by pass, outputs compared, and the median over
the passes of the gathered engines' mean over the as-loaded ones'.

    python bench/weight_slabs.py                  # the default model, batch 1, 2 engines of each
    python bench/weight_slabs.py --batch 4 --passes 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from data import DATASETS, chat  # noqa: E402
from interleave import interleaved_pass, sampling  # noqa: E402
from spectral import Engine  # noqa: E402


def engine(args: argparse.Namespace, gathered: bool) -> Engine:
    """An engine on `args.model_path`, its weights gathered or (the gather a no-op while it
    loads) where loading left them."""
    options = dict(
        model_path=args.model_path,
        dtype="float32",
        max_running_requests=args.batch,
        max_total_tokens=16384,
    )
    if gathered:
        return Engine(**options)
    with mock.patch("spectral.worker.model_worker.gather", lambda tensors: 0):
        return Engine(**options)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--engines", type=int, default=2, help="engines of each kind")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--passes", type=int, default=4)
    args = ap.parse_args()
    engines = {}
    for i in range(args.engines):  # alternately, each kind first in turn
        for gathered in (True, False) if i % 2 == 0 else (False, True):
            engines[f"{'gathered' if gathered else 'as-loaded'}-{i}"] = engine(args, gathered)
    first = next(iter(engines.values()))
    prompts = [chat(first.tokenizer, q) for q in DATASETS["mtbench"](args.num_prompts)]
    params = sampling(0.0, args.max_new_tokens)
    ratios = []
    for p in range(args.passes):
        timings = interleaved_pass(engines, prompts, params, len(prompts), reverse=p % 2 == 1)
        outputs = [t.outputs for t in timings.values()]
        same = all(o == outputs[0] for o in outputs)
        rates = {name: t.tok_s for name, t in timings.items()}
        print(
            f"pass {p + 1}: "
            + "  ".join(f"{name} {rate:7.2f}" for name, rate in rates.items())
            + f"  tok/s; outputs identical: {same}",
            flush=True,
        )
        kind = {
            k: statistics.mean(r for n, r in rates.items() if n.startswith(k))
            for k in ("gathered", "as-loaded")
        }
        ratios.append(kind["gathered"] / kind["as-loaded"])
    print(
        f"gathered against as loaded: {statistics.median(ratios):.3f}x (median of "
        f"{', '.join(f'{x:.3f}' for x in ratios)}), batch {args.batch}, {args.model_path}"
    )
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
