"""Several engines timed on the same prompts, in turns of a few steps (bench/spec.py).

A pass warms every engine up and flushes its cache, then walks the prompts a chunk at a time
(bench/spec.py: all of a pass's prompts in one chunk, each engine's batch refilled from its
queue as requests finish, as a server's is): every engine is given the chunk, then the
engines take turns of scheduler steps (TURN_S each), the order rotated by one every round,
until each has finished it. An engine's time in a pass is the sum of its steps': its cache and
n-gram index grow over the pass as in one run over every prompt, while engines compared are
never more than a turn of each apart in time. On these machines speed drifts 10-20% over tens of
seconds; a whole run of every prompt per engine put that drift between a run and the plain
one it was compared with. (Two plain engines in a pass were still 2-8% apart at batch 16
until the KV slots were handed out lowest first: spectral/mem/allocator.py.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from spectral import Engine

# An engine's turn: steps for this long. Short, so that the machine's drift between one
# engine's turn and the next's is small: the control (two plain engines, 5 passes of 8 HumanEval
# prompts at batch 1, 7 engines, an AMD EPYC) read 0.99-1.02x in turns of 0.5 s and 1.00-1.01x
# in turns of 0.1 s, plain's own speed the same in both. The first step of a turn reads the
# weights the other engines pushed out of the cache, the same cost for every engine.
TURN_S = 0.1


@dataclass
class PassTiming:
    """One engine's pass: seconds generating, tokens out, outputs, speculative rounds; and
    the part of it with the batch full (`full_*`: until the queue was empty and a request
    finished; at batch 1, all of it)."""

    seconds: float = 0.0
    tokens: int = 0
    outputs: list = field(default_factory=list)
    rounds: int = 0
    emitted: int = 0
    full_seconds: float = 0.0
    full_tokens: int = 0

    @property
    def tok_s(self) -> float:
        """Tokens/s with the batch full: the speed at the batch size timed. The last
        requests' drain, at smaller batches, is left out: where requests finish at staggered
        times (speculation's do) the last one admitted runs alone for a while, which is the
        end of a finite queue, not the batch's speed."""
        return self.full_tokens / self.full_seconds

    @property
    def whole_tok_s(self) -> float:
        """Tokens/s over the whole pass, the drain included."""
        return self.tokens / self.seconds

    @property
    def accept_length(self) -> float:
        """Tokens a speculative round and request (0 where no round ran)."""
        return self.emitted / self.rounds if self.rounds else 0.0


def sampling(temperature: float, new_tokens: int) -> dict:
    """Greedy, or at `temperature` with each request its own seeded stream (the same draws in
    every run)."""
    params = {"temperature": temperature, "max_new_tokens": new_tokens}
    if temperature > 0:
        params["seed"] = 0
    return params


def given(prompts: list) -> dict:
    """The Engine argument that takes `prompts`: `input_ids` for token ids, else `prompt`."""
    by_ids = bool(prompts) and isinstance(prompts[0], list)
    return {"input_ids" if by_ids else "prompt": prompts}


def generate(engine: Engine, prompts: list, params: dict) -> list[dict]:
    """`engine.generate` over prompts given as text or as token ids."""
    return engine.generate(**given(prompts), sampling_params=params)


def spec_counts(engine: Engine) -> tuple[int, int]:
    """The engine's speculative rounds and tokens they emitted, so far."""
    stats = engine.get_server_info()["stats"]
    return stats["spec_verify_ct"], stats["spec_emitted_tokens"]


@dataclass
class ChunkRun:
    """One engine's run of a chunk of prompts: its requests, seconds so far, and whether its
    batch is still full (until its queue is empty and a request has finished after that)."""

    engine: Engine
    reqs: list
    batch: int  # the engine's max_running_requests
    seconds: float = 0.0
    queued: bool = False  # given more prompts than its batch holds: a drain to leave out
    timed_full: bool = False  # its `full_*` part added to the pass's timing

    def steps(self, timing: PassTiming, seconds: float) -> bool:
        """Scheduler steps for about `seconds`, timed into `timing` (its `full_*` when the
        batch stops being full); whether work is left."""
        spent = 0.0
        while spent < seconds:
            began = time.perf_counter()
            working = self.engine.step()
            step = time.perf_counter() - began
            spent += step
            self.seconds += step
            timing.seconds += step
            if self.queued and not self.timed_full and self.draining():
                self.add_full(timing)
            if not working:
                return False
        return True

    def draining(self) -> bool:
        """The queue is empty and a request has finished: the batch is no longer full."""
        scheduler = self.engine.scheduler
        return not scheduler.waiting and len(scheduler.running) < self.batch

    def add_full(self, timing: PassTiming) -> None:
        """Its run so far as the batch-full part of `timing`."""
        self.timed_full = True
        timing.full_seconds += self.seconds
        timing.full_tokens += sum(len(req.output_ids) for req in self.reqs)


def interleaved_pass(
    engines: dict[str, Engine],
    prompts: list,
    params: dict,
    chunk: int,
    reverse: bool = False,
    turn_s: float = TURN_S,
) -> dict[str, PassTiming]:
    """Time every engine over `prompts`, `chunk` prompts at a time, `turn_s` of steps of
    each in turn (see the module); `reverse` starts from the engines' order reversed
    (alternate it between passes)."""
    names = list(engines)[::-1] if reverse else list(engines)
    for engine in engines.values():
        generate(engine, prompts[:1], {**params, "max_new_tokens": 8})  # warm-up
        engine.flush_cache()
    before = {name: spec_counts(engine) for name, engine in engines.items()}
    timings = {name: PassTiming() for name in engines}
    for start in range(0, len(prompts), chunk):
        texts = prompts[start : start + chunk]
        runs = {}
        for name, engine in engines.items():
            batch = engine.args.max_running_requests
            reqs = engine.submit(**given(texts), sampling_params=params)
            runs[name] = ChunkRun(engine, reqs, batch, queued=len(texts) > batch > 1)
        busy, turn = list(names), 0
        while busy:
            for name in busy[turn % len(busy) :] + busy[: turn % len(busy)]:
                if not runs[name].steps(timings[name], turn_s):
                    busy.remove(name)
            turn += 1
        for name, run in runs.items():
            timing, reqs = timings[name], run.reqs
            unfinished = [req.rid for req in reqs if not req.finished]
            if unfinished:
                raise RuntimeError(f"{name}: requests {unfinished} stopped unfinished")
            if not run.timed_full:  # no drain (batch 1, or never queued): all of it
                run.add_full(timing)
            timing.tokens += sum(len(req.output_ids) for req in reqs)
            timing.outputs.extend(list(req.output_ids) for req in reqs)
    for name, engine in engines.items():
        rounds, emitted = spec_counts(engine)
        timings[name].rounds = rounds - before[name][0]
        timings[name].emitted = emitted - before[name][1]
    return timings
