"""Schema-constrained generation: plain decoding against EAGLE3 with and without the grammar's
forced tokens as drafts, in one run.

Prompts ask for JSON under four schemas (a person, an order, an event, a book; `--num-prompts`
of them, cycling), greedy, with the model's chat template. For each batch size it prints tokens/s
of plain decoding (before and after the speculative runs; speedups are against the faster of
the two), then for EAGLE3 (the shipped head, n-gram trees where text repeats: the server's
defaults) without and with grammar drafts: tokens/s, τ (tokens per speculative round and
request), outputs equal to plain decoding's, and the grammar's share of the run: the time spent
filling and applying masks, walking trees, following and advancing matchers and finding forced
text, over the wall time. Results also go to bench/out/structured.json.

    python bench/structured.py
    python bench/structured.py --batches 1 --num-prompts 8
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import chat  # noqa: E402
from spec import timed_generate  # noqa: E402
from spectral import Engine, constrained  # noqa: E402
from spectral.scheduler.schedule_batch import ScheduleBatch  # noqa: E402
from spectral.worker import sampler, spec_worker  # noqa: E402

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string"},
            "city": {"type": "string"},
        },
        "required": ["name", "age", "email", "city"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"type": "number"},
                    },
                    "required": ["product", "quantity", "unit_price"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            },
            "paid": {"type": "boolean"},
        },
        "required": ["order_id", "items", "paid"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
            "location": {"type": "string"},
            "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["title", "date", "location", "attendees"],
        "additionalProperties": False,
    },
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "author": {"type": "string"},
            "year": {"type": "integer"},
            "genre": {"type": "string", "enum": ["fiction", "science", "history", "poetry"]},
        },
        "required": ["title", "author", "year", "genre"],
        "additionalProperties": False,
    },
}
SUBJECTS = {
    "person": ["a software engineer in Berlin", "a retired teacher", "a young chef", "a pilot"],
    "order": ["three books", "a laptop and a mouse", "groceries for a week", "garden tools"],
    "event": ["a team meeting", "a wedding", "a science fair", "a concert in the park"],
    "book": ["a famous novel", "a book about stars", "a history of Rome", "a poetry collection"],
}


def requests(tokenizer, n: int) -> list[tuple[str, str]]:
    """(prompt, schema text) pairs, cycling over the schemas."""
    out = []
    for i in range(n):
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        subject = SUBJECTS[name][(i // len(SCHEMAS)) % len(SUBJECTS[name])]
        question = f"Describe {subject} as a JSON object with the fields of a {name} record."
        out.append((chat(tokenizer, question), json.dumps(SCHEMAS[name])))
    return out


class GrammarClock:
    """Seconds spent in spectral's grammar work, by wrapping the functions that do it (a call
    inside another counts once)."""

    TARGETS = [
        (spec_worker.SpeculativeWorker, "_grammar_masks"),  # follow + walk each tree
        (ScheduleBatch, "_vocab_mask"),  # plain steps: fill each request's row
        (constrained.Grammar, "accept"),
        (constrained.Grammar, "forced_tokens"),
        (spec_worker, "apply_bitmask"),
        (sampler, "apply_bitmask"),
    ]

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._saved = []

    def __enter__(self) -> GrammarClock:
        for owner, name in self.TARGETS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(original))
        return self

    def _timed(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - start

        return timed

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def measure(engine: Engine, reqs: list[tuple[str, str]], new_tokens: int) -> dict:
    params = [
        {"temperature": 0.0, "max_new_tokens": new_tokens, "json_schema": schema}
        for _, schema in reqs
    ]
    clock = GrammarClock()
    outs, elapsed, tau = timed_generate(engine, [p for p, _ in reqs], params, during=clock)
    valid = 0
    for o in outs:
        try:
            json.loads(o["text"])
            valid += o["meta_info"]["finish_reason"]["type"] == "stop"
        except ValueError:
            pass
    return {
        "tok_s": sum(len(o["output_ids"]) for o in outs) / elapsed,
        "outputs": [o["output_ids"] for o in outs],
        "tau": tau,
        "grammar_share": clock.seconds / elapsed,
        "complete_json": valid,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--draft", default="default", help="EAGLE3 head directory")
    ap.add_argument(
        "--fixed-tree", action="store_true", help="every round the full tree (no planner)"
    )
    ap.add_argument("--out", default="structured.json", help="file name under bench/out")
    args = ap.parse_args()

    common = dict(model_path=args.model_path, dtype=args.dtype, max_total_tokens=65536)
    variants = {
        "EAGLE3": dict(speculative_disable_grammar_drafts=True),
        "EAGLE3+grammar drafts": {},
    }
    results = {
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "runs": [],
    }
    for size in [int(b) for b in args.batches.split(",") if b]:
        engine = Engine(**common, max_running_requests=size)
        reqs = requests(engine.tokenizer, args.num_prompts)
        plain = measure(engine, reqs, args.max_new_tokens)
        engine.shutdown()
        print(
            f"batch {size:3d}  plain                  {plain['tok_s']:7.2f} tok/s  "
            f"grammar {plain['grammar_share']:5.1%}  complete JSON "
            f"{plain['complete_json']}/{len(reqs)}"
        )
        rows = []
        for name, options in variants.items():
            engine = Engine(
                **common,
                max_running_requests=size,
                speculative_algorithm="EAGLE3",
                speculative_draft_model_path=args.draft,
                speculative_fixed_tree=args.fixed_tree,
                speculative_max_batch_size=size if args.fixed_tree else None,
                **options,
            )
            run = measure(engine, reqs, args.max_new_tokens)
            engine.shutdown()
            gc.collect()
            same = sum(a == b for a, b in zip(run["outputs"], plain["outputs"]))
            rows.append((name, run, same))
        engine = Engine(**common, max_running_requests=size)
        again = measure(engine, reqs, args.max_new_tokens)
        engine.shutdown()
        gc.collect()
        baseline = max(plain["tok_s"], again["tok_s"])
        print(
            f"batch {size:3d}  plain again            {again['tok_s']:7.2f} tok/s  "
            f"(drift {again['tok_s'] / plain['tok_s'] - 1:+.1%}); against the faster:"
        )
        for name, run, same in rows:
            print(
                f"batch {size:3d}  {name:<22s} {run['tok_s']:7.2f} tok/s  "
                f"{run['tok_s'] / baseline:5.2f}x  τ {run['tau']:4.2f}  grammar "
                f"{run['grammar_share']:5.1%}  identical {same}/{len(reqs)}  complete JSON "
                f"{run['complete_json']}/{len(reqs)}"
            )
            results["runs"].append(
                {
                    "batch": size,
                    "algorithm": name,
                    "plain_tok_s": round(baseline, 2),
                    "plain_tok_s_runs": [round(plain["tok_s"], 2), round(again["tok_s"], 2)],
                    "spec_tok_s": round(run["tok_s"], 2),
                    "speedup": round(run["tok_s"] / baseline, 3),
                    "accept_length": round(run["tau"], 3),
                    "grammar_share": round(run["grammar_share"], 4),
                    "plain_grammar_share": round(plain["grammar_share"], 4),
                    "identical_outputs": f"{same}/{len(reqs)}",
                    "complete_json": f"{run['complete_json']}/{len(reqs)}",
                }
            )
    out = Path(__file__).resolve().parent / "out" / args.out
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
