"""Several engines timed on the same prompts, interleaved chunk by chunk (bench/spec.py).

A pass warms every engine up and flushes its cache, then walks the prompts a chunk at a time
(by default as many prompts as the batch holds: one at a time at batch 1), and each engine
generates the chunk in turn, the order reversed every other chunk. An engine's time in a pass
is the sum of its chunks': its cache and n-gram index grow over the pass as in one run over
every prompt, while engines compared are never more than a chunk apart in time. On these
machines speed drifts 10-20% over tens of seconds; a whole run of every prompt per engine put
that drift between a run and the plain one it was compared with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from spectral import Engine


@dataclass
class PassTiming:
    """One engine's pass: seconds generating, tokens out, outputs, speculative rounds."""

    seconds: float = 0.0
    tokens: int = 0
    outputs: list = field(default_factory=list)
    rounds: int = 0
    emitted: int = 0

    @property
    def tok_s(self) -> float:
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


def generate(engine: Engine, prompts: list, params: dict) -> list[dict]:
    """`engine.generate` over prompts given as text or as token ids."""
    by_ids = bool(prompts) and isinstance(prompts[0], list)  # token ids rather than text
    key = "input_ids" if by_ids else "prompt"
    return engine.generate(**{key: prompts}, sampling_params=params)


def spec_counts(engine: Engine) -> tuple[int, int]:
    """The engine's speculative rounds and tokens they emitted, so far."""
    stats = engine.get_server_info()["stats"]
    return stats["spec_verify_ct"], stats["spec_emitted_tokens"]


def interleaved_pass(
    engines: dict[str, Engine], prompts: list, params: dict, chunk: int, reverse: bool = False
) -> dict[str, PassTiming]:
    """Time every engine over `prompts`, `chunk` prompts at a time in turn (see the module);
    `reverse` starts with the engines' order reversed (alternate it between passes)."""
    names = list(engines)
    for engine in engines.values():
        generate(engine, prompts[:1], {**params, "max_new_tokens": 8})  # warm-up
        engine.flush_cache()
    before = {name: spec_counts(engine) for name, engine in engines.items()}
    timings = {name: PassTiming() for name in names}
    for c, start in enumerate(range(0, len(prompts), chunk)):
        part = prompts[start : start + chunk]
        order = names[::-1] if (c % 2 == 1) != reverse else names
        for name in order:
            began = time.perf_counter()
            outs = generate(engines[name], part, params)
            timing = timings[name]
            timing.seconds += time.perf_counter() - began
            timing.tokens += sum(len(o["output_ids"]) for o in outs)
            timing.outputs.extend(o["output_ids"] for o in outs)
    for name, engine in engines.items():
        rounds, emitted = spec_counts(engine)
        timings[name].rounds = rounds - before[name][0]
        timings[name].emitted = emitted - before[name][1]
    return timings
