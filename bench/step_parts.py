"""Where a step's host time goes: plain decode steps and speculative rounds, part by part.

One engine generates the prompts twice (the second timed, from a flushed cache); timers on the
scheduler's and the worker's parts sum what each took per step of each kind (DECODE,
TARGET_VERIFY, EXTEND), beside the step itself and the model's forward
(`ModelWorker.forward_batch`), so that a step's host time (the step less its forward) is
split into what runs it: the plan (the drafters' lookups and the tree planner), the batch
built for the worker, the trees laid out, their verification, the result taken in. Parts nest
(`SpeculativeWorker._round` holds `verify_trees`), so they do not add up. The timers sit on the
real steps, after the forward has run through the caches: the host's code runs there several
times slower than in a loop of its own (docs/benchmarks.md, 2026-12-02).

    python bench/step_parts.py                                # NGRAM, batch 1, MT-Bench
    python bench/step_parts.py --algorithm EAGLE3+NGRAM --batch 4 --num-prompts 16
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spectral.worker.spec_worker as spec_worker  # noqa: E402
from bench.data import DATASETS, chat  # noqa: E402
from bench.spec_idle import make_engine  # noqa: E402
from spectral.scheduler.schedule_batch import ScheduleBatch  # noqa: E402
from spectral.scheduler.scheduler import Scheduler  # noqa: E402
from spectral.speculative.sources.round import SpecRound  # noqa: E402
from spectral.worker.model_worker import ModelWorker  # noqa: E402
from spectral.worker.spec_worker import SpeculativeWorker  # noqa: E402

FORWARD = "ModelWorker.forward_batch"
PARTS = [
    (Scheduler, "_next_batch"),
    (SpecRound, "plan"),
    (ScheduleBatch, "to_worker_batch"),
    (ModelWorker, "to_forward_batch"),
    (ModelWorker, "forward_batch"),
    (SpeculativeWorker, "_trees"),
    (SpeculativeWorker, "_round"),
    (spec_worker, "verify_trees"),
    (spec_worker, "stage"),
    (spec_worker, "round_result"),
    (Scheduler, "_process_result"),
    (SpecRound, "observe"),
    (SpecRound, "record_step"),
]

# (step kind, part) -> [seconds, calls]; the step running now files under None until it ends
timers: dict[tuple, list] = defaultdict(lambda: [0.0, 0])


def timed(owner, name: str) -> None:
    """Time `owner.name` (a class's method or a module's function) into `timers`."""
    inner = getattr(owner, name)
    label = f"{getattr(owner, '__name__', '').rsplit('.', 1)[-1]}.{name}"

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            entry = timers[(None, label)]
            entry[0] += time.perf_counter() - start
            entry[1] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    for owner, name in PARTS:
        timed(owner, name)
    inner = Scheduler.step

    def step(self):
        start = time.perf_counter()
        out = inner(self)
        seconds = time.perf_counter() - start
        kind = self.last_mode.name if self.last_mode is not None else "NONE"
        for key in [key for key in timers if key[0] is None]:  # this step's parts
            seconds_calls = timers.pop(key)
            entry = timers[(kind, key[1])]
            entry[0] += seconds_calls[0]
            entry[1] += seconds_calls[1]
        entry = timers[(kind, "step")]
        entry[0] += seconds
        entry[1] += 1
        return out

    Scheduler.step = step


def report(kind: str) -> None:
    steps = timers[(kind, "step")][1]
    if not steps:
        return
    per_step = {part: 1e6 * s / steps for (k, part), (s, _) in timers.items() if k == kind}
    host = per_step["step"] - per_step.get(FORWARD, 0.0)
    print(
        f"{kind}: {steps} steps, {per_step['step']:.0f} us a step, the forward "
        f"{per_step.get(FORWARD, 0.0):.0f}, host {host:.0f} ({host / per_step['step']:.1%})"
    )
    for part, us in sorted(per_step.items(), key=lambda item: -item[1]):
        if part not in ("step", FORWARD):
            calls = timers[(kind, part)][1]
            print(f"    {part:<34s} {us:8.1f} us a step  ({calls} calls)")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--algorithm", default="NGRAM", help="PLAIN, or as bench/spec.py names it")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dataset", default="mtbench", choices=list(DATASETS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = make_engine(args.algorithm, args.batch)
    prompts = [chat(engine.tokenizer, q) for q in DATASETS[args.dataset](args.num_prompts)]
    params = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    engine.generate(prompts, params)  # warm: the n-gram index and the planner as in a run
    engine.flush_cache()
    instrument()
    engine.generate(prompts, params)
    for kind in ("DECODE", "TARGET_VERIFY", "EXTEND"):
        report(kind)
    engine.shutdown()


if __name__ == "__main__":
    main()
