"""The speculative algorithms by name (`--speculative-algorithm`): one entry each, with its
defaults and what the rest of spectral needs to know of it. A drafter that runs in the model
worker is one module with a `build(ctx: DrafterContext) -> Drafter` function
(speculative.drafters.base) and one line here; `register` adds one from elsewhere (a plugin,
a test). Nothing outside this module and the settings parser compares algorithm names.

Torch-free: every process parses the settings; a drafter's module is imported only to build
it, in the model worker.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

HEAD_PATH = "a head directory, or 'default' for the head shipped for the default model"


@dataclass(frozen=True)
class Algorithm:
    name: str
    # (num_steps, topk, num_draft_tokens) for the embedded model on a CPU (bench/spec_tune.py)
    defaults: tuple[int, int, int]
    # "module:function" building the worker-side Drafter; None: drafted in the scheduler from
    # the text itself (n-gram sources)
    drafter: str | None = None
    # what --speculative-draft-model-path must name (said when it is missing); None: no path
    draft_path: str | None = None
    # the path taken when none is given and the target is the embedded default model
    default_draft_path: str | None = None
    # the drafter's KV at position p pairs the target's feature there with token p + 1 (EAGLE
    # heads): the scheduler sends the token after a prefill chunk, and a cache hit recomputes
    kv_pairs_next_token: bool = False
    # its upkeep of plain decode steps (the target's captured states, its KV) may stop while
    # the planner gives it no tree for a long stretch (`SpecRound.head_idle`): its KV then
    # misses those positions, so its later drafts may be worse, never wrong (they are verified)
    idles: bool = False
    # LOOKAHEAD's Jacobi window and n-gram pool draft
    lookahead: bool = False
    # what --speculative-draft-quantization auto means for it
    auto_quantization: str = "q8_0"
    # (first-rank acceptance, decay by rank) its drafts are planned by before any is
    # verified; None: the n-gram prior
    acceptance_prior: tuple[float, float] | None = None
    # takes --speculative-token-map (the draft's vocabulary restricted)
    token_map: bool = False
    # drafts from a datastore (--speculative-datastore) alone: no n-gram matches of its own
    datastore_only: bool = False
    # its KV over what a request committed since it last drafted for it is computed before it
    # drafts again (a draft model's lazy catch-up): the planner charges a request's tree that
    # (the cost model's `catch_up` a token)
    catches_up: bool = False
    # the shortest suffix its n-gram trees (its own, or a hybrid's) match by default
    ngram_min_match: int = 2

    @property
    def model_free(self) -> bool:
        return self.drafter is None

    def build(self, ctx: Any) -> Any:
        """The worker-side drafter, built by the module the entry names."""
        if self.drafter is None:
            raise ValueError(f"{self.name} drafts in the scheduler; it has no worker drafter")
        module, _, function = self.drafter.partition(":")
        return getattr(importlib.import_module(module), function)(ctx)


_DRAFTERS = "spectral.speculative.drafters"
_ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add (or replace) an algorithm under its name, upper-case."""
    _ALGORITHMS[algorithm.name.upper()] = algorithm
    return algorithm


def get(name: str) -> Algorithm:
    """The algorithm named `name` (any case); ValueError lists the known ones."""
    found = _ALGORITHMS.get((name or "").upper())
    if found is None:
        raise ValueError(
            f"speculative_algorithm must be one of {', '.join(names())} (got {name!r})"
        )
    return found


def names() -> tuple[str, ...]:
    return tuple(_ALGORITHMS)


register(
    Algorithm(
        "EAGLE",
        (3, 2, 4),
        f"{_DRAFTERS}.eagle:build",
        HEAD_PATH,
        kv_pairs_next_token=True,
        idles=True,
    )
)
register(
    Algorithm(
        "EAGLE3",
        (3, 2, 4),
        f"{_DRAFTERS}.eagle:build",
        HEAD_PATH,
        default_draft_path="default",
        kv_pairs_next_token=True,
        idles=True,
    )
)
register(
    Algorithm(
        "STANDALONE",
        (4, 2, 6),
        f"{_DRAFTERS}.draft_model:build",
        "a small LM with the target's tokenizer (a GGUF file or a HF model directory)",
        auto_quantization="none",
        # a small LM of the target's family agrees with it on most tokens (with the n-gram
        # prior, a draft costing a fair share of a target step would never be tried, and so
        # never measured)
        acceptance_prior=(0.8, 0.9),
        token_map=True,
        catches_up=True,
    )
)
register(
    Algorithm(
        "MEDUSA",
        (3, 2, 4),
        f"{_DRAFTERS}.medusa:build",
        "a Medusa head directory (config.json with medusa_num_heads, "
        "medusa_lm_head.safetensors; `spectral train-medusa` writes one)",
    )
)
# An n-gram tree costs nothing to draft and the planner sizes it by what a round costs, so its
# cap is as deep as llama.cpp's n-gram drafts: 16 against 4 gained 4-12% at batch 1 (the default
# model's HumanEval, the 1.5B's) and up to 3% at batch 4. Where no longer suffix matches, its
# trees start from one-token matches (acceptance is learnt per match length): 1.04-1.08x on
# HumanEval, MT-Bench even (docs/benchmarks.md, 2026-11-29).
register(Algorithm("NGRAM", (15, 1, 16), ngram_min_match=1))
register(Algorithm("LOOKAHEAD", (3, 1, 6), lookahead=True))
register(Algorithm("REST", (4, 1, 8), datastore_only=True))
