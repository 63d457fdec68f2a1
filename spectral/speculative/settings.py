"""SpecSettings: the speculative-decoding flags of `ServerArgs`, checked, with defaults."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from spectral.speculative import registry
from spectral.speculative.registry import Algorithm

# LOOKAHEAD: window W, n-gram size N, guesses G (LADE's names), sized for a CPU where a verify
# forward's extra tokens are not free.
DEFAULT_LOOKAHEAD = (3, 3, 2)
# The longest suffix an n-gram source matches (the shortest is the algorithm's
# `ngram_min_match`).
DEFAULT_NGRAM_MAX_MATCH = 4
# With fixed trees (--speculative-fixed-tree), above this many running requests a round costs
# more than it gains on a CPU; decode plainly there (the head keeps its KV, so speculation
# resumes when the batch shrinks). The planner needs no such limit.
DEFAULT_FIXED_MAX_BATCH_SIZE = 1
NO_LIMIT = 1 << 30
# EAGLE/EAGLE3: n-gram trees of up to this many tokens where the request's last tokens repeat
# earlier ones (0: the head drafts every round; docs/speculative.md, "Hybrid n-gram trees").
DEFAULT_HYBRID_NGRAM = 8
# --speculative-draft-quantization: auto is q8_0 for a head, the file's own for a draft model
DRAFT_QUANTIZATIONS = ("auto", "q8_0", "q4_1", "none")


@dataclass(frozen=True)
class SpecSettings:
    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    draft_model_path: str | None
    max_batch_size: int
    ngram_min_match: int
    ngram_max_match: int
    # EAGLE/EAGLE3: the size (root included) of the n-gram trees that rounds where the n-gram
    # drafter matches verify instead of the head's tree; 0 = no n-gram trees
    hybrid_ngram: int = 0
    # the n-gram tree joins the head's tree (one tree, their union) instead of replacing it
    hybrid_merge: bool = False
    # every request verifies num_draft_tokens nodes (no planner), and a cost model given by hand
    fixed_tree: bool = False
    cost_model_path: str | None = None
    # a request under a grammar drafts the text its grammar forces next
    grammar_drafts: bool = True
    # GGUF block type the draft's matmul weights are quantized to for the CPU kernels (a
    # head's all, a draft model's stored in more bits a weight), or None
    draft_quantization: str | None = "Q8_0"
    # STANDALONE: a file of the token ids the draft model drafts from (drafters.token_map)
    token_map: str | None = None
    # LOOKAHEAD: (window W, n-gram size N, guesses G)
    lookahead: tuple[int, int, int] = DEFAULT_LOOKAHEAD
    # a drafter's n-gram trees also carry LOOKAHEAD's window and pool
    hybrid_lookahead: bool = False
    # REST: a datastore (`spectral datastore build`) whose continuations join the n-gram trees
    datastore: str | None = None

    @functools.cached_property
    def entry(self) -> Algorithm:
        """The algorithm's registry entry (looked up once: the scheduler reads it every step)."""
        return registry.get(self.algorithm)

    @functools.cached_property
    def has_drafter(self) -> bool:
        """A drafter runs in the worker (an EAGLE head, a draft model, Medusa heads, ...)."""
        return not self.entry.model_free

    @property
    def kv_pairs_next_token(self) -> bool:
        """The drafter's KV at position p pairs the target's feature there with token p + 1."""
        return self.entry.kv_pairs_next_token

    @property
    def uses_lookahead(self) -> bool:
        """LOOKAHEAD's window and pool draft (alone, or beside a drafter's trees)."""
        return self.entry.lookahead or self.hybrid_lookahead

    @property
    def uses_ngram(self) -> bool:
        """The scheduler drafts n-gram trees (from the text seen, a datastore, or both)."""
        return self.entry.model_free or self.hybrid_ngram > 0

    @property
    def ngram_matches(self) -> bool:
        """Its n-gram trees match the context and past requests (not REST's: datastore only)."""
        return not self.entry.datastore_only

    @property
    def ngram_tree_shape(self) -> tuple[int, int]:
        """(most non-root nodes, most depth) of an n-gram tree: a hybrid's may be one chain of
        `hybrid_ngram - 1` nodes; NGRAM's fills the usual tree (num_draft_tokens, num_steps)."""
        if self.hybrid_ngram:
            return self.hybrid_ngram - 1, self.hybrid_ngram - 1
        return self.num_draft_tokens - 1, self.num_steps

    @classmethod
    def from_args(cls, args: Any) -> SpecSettings:
        """The settings of a ServerArgs' speculative_* flags (read by name), checked; ValueError
        names the flag that is wrong and what is allowed."""
        entry = registry.get(args.speculative_algorithm)
        steps, topk, tokens = tree_settings(entry, args)
        # Merged trees are sized by hand: the planner learns acceptance of one drafter's tree.
        fixed = args.speculative_fixed_tree or args.speculative_hybrid_merge
        max_batch = args.speculative_max_batch_size
        if max_batch is None:
            max_batch = DEFAULT_FIXED_MAX_BATCH_SIZE if fixed else NO_LIMIT
        if max_batch < 0:
            raise ValueError(f"speculative_max_batch_size must be >= 0 (got {max_batch})")
        cost_path = args.speculative_cost_model
        if cost_path is not None and fixed:
            raise ValueError(
                "--speculative-cost-model sizes trees by the planner; it does not go with "
                "--speculative-fixed-tree or --speculative-hybrid-merge (sized by hand)"
            )
        hybrid, merge, hybrid_lookahead = hybrid_settings(entry, args)
        return cls(
            entry.name,
            steps,
            topk,
            tokens,
            draft_path(entry, args),
            max_batch,
            *ngram_match(entry, args),
            hybrid,
            merge,
            fixed,
            cost_path,
            grammar_drafts=not args.speculative_disable_grammar_drafts,
            draft_quantization=draft_quantization(entry, args),
            token_map=token_map(entry, args),
            lookahead=lookahead_settings(args),
            hybrid_lookahead=hybrid_lookahead,
            datastore=datastore_path(entry, args, hybrid),
        )


def tree_settings(entry: Algorithm, args: Any) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens): the flags, else the algorithm's defaults."""
    steps, topk, tokens = entry.defaults
    steps = args.speculative_num_steps or steps
    topk = args.speculative_eagle_topk or topk
    tokens = args.speculative_num_draft_tokens or tokens
    for name, value in (("num_steps", steps), ("eagle_topk", topk), ("num_draft_tokens", tokens)):
        if value < 1:
            raise ValueError(f"speculative_{name} must be >= 1 (got {value})")
    if tokens < 2:
        raise ValueError(
            f"speculative_num_draft_tokens counts the root too and must be >= 2 (got {tokens})"
        )
    most = 1 + topk + (steps - 1) * topk * topk
    if not entry.model_free and tokens > most:
        raise ValueError(
            f"speculative_num_draft_tokens {tokens} exceeds what {steps} steps of "
            f"top-{topk} can draft ({most} with the root)"
        )
    return steps, topk, tokens


def draft_path(entry: Algorithm, args: Any) -> str | None:
    """--speculative-draft-model-path, or the algorithm's default for the embedded model;
    refused where the algorithm takes none, asked for where it needs one."""
    path = args.speculative_draft_model_path
    if not path and args.model_path == "default":
        path = entry.default_draft_path  # shipped for the embedded default model
    if entry.draft_path and not path:
        raise ValueError(
            f"--speculative-algorithm {entry.name} needs --speculative-draft-model-path: "
            f"{entry.draft_path}"
        )
    if entry.draft_path is None and path:
        raise ValueError(
            f"{entry.name} drafts without a model; drop --speculative-draft-model-path"
        )
    return path


def ngram_match(entry: Algorithm, args: Any) -> tuple[int, int]:
    """(shortest, longest) suffix an n-gram source matches."""
    ngram_min = args.speculative_ngram_min_match_window_size or entry.ngram_min_match
    ngram_max = args.speculative_ngram_max_match_window_size or max(
        DEFAULT_NGRAM_MAX_MATCH, ngram_min
    )
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError(
            "need 1 <= speculative_ngram_min_match_window_size <= "
            f"speculative_ngram_max_match_window_size (got {ngram_min} and {ngram_max})"
        )
    return ngram_min, ngram_max


def hybrid_settings(entry: Algorithm, args: Any) -> tuple[int, bool, bool]:
    """(n-gram tree size beside a drafter, merged with its trees, LOOKAHEAD beside it)."""
    hybrid = args.speculative_hybrid_ngram
    if hybrid is None:
        hybrid = 0 if entry.model_free else DEFAULT_HYBRID_NGRAM
    if hybrid and entry.model_free:
        raise ValueError(
            "--speculative-hybrid-ngram pairs n-gram drafts with a drafter's "
            f"({', '.join(drafter_algorithms())}); {entry.name} drafts without one"
        )
    if hybrid == 1 or hybrid < 0:
        raise ValueError(
            "speculative_hybrid_ngram is the n-gram tree size, root included: >= 2, or "
            f"0 for none (got {hybrid})"
        )
    merge = args.speculative_hybrid_merge
    if merge and not hybrid:
        raise ValueError(
            "--speculative-hybrid-merge joins n-gram trees to the head's: it needs "
            "EAGLE or EAGLE3 with --speculative-hybrid-ngram >= 2"
        )
    hybrid_lookahead = args.speculative_hybrid_lookahead
    if hybrid_lookahead and not hybrid:
        raise ValueError(
            "--speculative-hybrid-lookahead adds LOOKAHEAD's window and pool to a drafter's "
            f"n-gram trees: it needs {', '.join(drafter_algorithms())} with "
            "--speculative-hybrid-ngram >= 2 (LOOKAHEAD alone: --speculative-algorithm "
            "LOOKAHEAD)"
        )
    return hybrid, merge, hybrid_lookahead


def draft_quantization(entry: Algorithm, args: Any) -> str | None:
    """The GGUF block type of the draft's matmul weights, or None (as stored)."""
    quant = (args.speculative_draft_quantization or "none").lower()
    if quant not in DRAFT_QUANTIZATIONS:
        raise ValueError(
            f"speculative_draft_quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)} "
            f"(got {quant!r})"
        )
    if quant == "auto":  # a head's float weights to 8 bits; a draft model's as stored
        quant = entry.auto_quantization
    return None if quant == "none" else quant.upper()


def token_map(entry: Algorithm, args: Any) -> str | None:
    """--speculative-token-map, where the algorithm takes one."""
    path = args.speculative_token_map
    if path is not None and not entry.token_map:
        takes = " or ".join(a.name for a in map(registry.get, registry.names()) if a.token_map)
        raise ValueError(
            "--speculative-token-map restricts a draft model's vocabulary: it goes with "
            f"--speculative-algorithm {takes} (got {entry.name})"
        )
    return path


def datastore_path(entry: Algorithm, args: Any, hybrid: int) -> str | None:
    """--speculative-datastore, where the algorithm drafts n-gram trees for it to join."""
    path = args.speculative_datastore
    if entry.datastore_only and not path:
        raise ValueError(
            f"--speculative-algorithm {entry.name} drafts from a datastore: give "
            "--speculative-datastore DIR (`spectral datastore build` makes one)"
        )
    if path and not (entry.model_free or hybrid):
        raise ValueError(
            "--speculative-datastore joins the n-gram trees: with "
            f"{entry.name} it needs --speculative-hybrid-ngram >= 2"
        )
    return path


def drafter_algorithms() -> list[str]:
    """The algorithms whose drafter runs in the worker."""
    return [name for name in registry.names() if not registry.get(name).model_free]


def lookahead_settings(args: Any) -> tuple[int, int, int]:
    """(W, N, G) from --speculative-lookahead-{window,ngram,guesses}, checked."""
    given = (
        args.speculative_lookahead_window,
        args.speculative_lookahead_ngram,
        args.speculative_lookahead_guesses,
    )
    window, ngram, guesses = (d if v is None else v for v, d in zip(given, DEFAULT_LOOKAHEAD))
    if window < 1 or ngram < 2 or guesses < 0:
        raise ValueError(
            "LOOKAHEAD needs --speculative-lookahead-window >= 1, --speculative-lookahead-ngram "
            f">= 2 and --speculative-lookahead-guesses >= 0 (got {window}, {ngram}, {guesses})"
        )
    return window, ngram, guesses
