"""SpecSettings: the speculative-decoding flags of `ServerArgs`, checked, with defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "MEDUSA", "NGRAM", "LOOKAHEAD")
# The algorithms that draft without a model (in the scheduler, from the text itself).
MODEL_FREE = ("NGRAM", "LOOKAHEAD")

# Defaults for the embedded model on a CPU: (num_steps, topk, num_draft_tokens), tuned with
# bench/spec_tune.py (docs/speculative.md, "Batch sizes and tree shapes").
DEFAULTS = {
    "EAGLE": (3, 2, 4),
    "EAGLE3": (3, 2, 4),
    "STANDALONE": (4, 2, 6),
    "MEDUSA": (3, 2, 4),
    "NGRAM": (3, 1, 4),
    "LOOKAHEAD": (3, 1, 6),
}
# LOOKAHEAD: window W, n-gram size N, guesses G (LADE's names), sized for a CPU where a verify
# forward's extra tokens are not free.
DEFAULT_LOOKAHEAD = (3, 3, 2)
# NGRAM drafts only from a suffix match of at least this many tokens (one-token matches are
# right too rarely to pay for their verification).
DEFAULT_NGRAM_MIN_MATCH = 2
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
    # STANDALONE: a file of the token ids the draft model drafts from (speculative.token_map)
    token_map: str | None = None
    # LOOKAHEAD: (window W, n-gram size N, guesses G)
    lookahead: tuple[int, int, int] = DEFAULT_LOOKAHEAD
    # a drafter's n-gram trees also carry LOOKAHEAD's window and pool
    hybrid_lookahead: bool = False

    @property
    def uses_draft_head(self) -> bool:
        """A drafter runs in the worker: an EAGLE head, a draft model (STANDALONE) or Medusa
        heads."""
        return self.algorithm not in MODEL_FREE

    @property
    def is_eagle(self) -> bool:
        """The drafter is an EAGLE head: its KV at position p pairs the target's feature there
        with token p + 1."""
        return self.algorithm in ("EAGLE", "EAGLE3")

    @property
    def uses_lookahead(self) -> bool:
        """LOOKAHEAD's window and pool draft (alone, or beside a drafter's trees)."""
        return self.algorithm == "LOOKAHEAD" or self.hybrid_lookahead

    @property
    def uses_ngram(self) -> bool:
        return self.algorithm in MODEL_FREE or self.hybrid_ngram > 0

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
        algo = (args.speculative_algorithm or "").upper()
        if algo not in ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {', '.join(ALGORITHMS)} "
                f"(got {args.speculative_algorithm!r})"
            )
        steps, topk, tokens = DEFAULTS[algo]
        steps = args.speculative_num_steps or steps
        topk = args.speculative_eagle_topk or topk
        tokens = args.speculative_num_draft_tokens or tokens
        path = args.speculative_draft_model_path
        if algo == "EAGLE3" and not path and args.model_path == "default":
            path = "default"  # the head shipped for the embedded default model
        if algo in ("EAGLE", "EAGLE3") and not path:
            raise ValueError(
                f"--speculative-algorithm {algo} needs --speculative-draft-model-path "
                "(a head directory, or 'default' for the head shipped for the default model)"
            )
        if algo == "STANDALONE" and not path:
            raise ValueError(
                "--speculative-algorithm STANDALONE needs --speculative-draft-model-path: a "
                "small LM with the target's tokenizer (a GGUF file or a HF model directory)"
            )
        if algo == "MEDUSA" and not path:
            raise ValueError(
                "--speculative-algorithm MEDUSA needs --speculative-draft-model-path: a Medusa "
                "head directory (config.json with medusa_num_heads, medusa_lm_head.safetensors; "
                "`spectral train-medusa` writes one)"
            )
        if algo in MODEL_FREE and path:
            raise ValueError(f"{algo} drafts without a model; drop --speculative-draft-model-path")
        for name, value in (
            ("num_steps", steps),
            ("eagle_topk", topk),
            ("num_draft_tokens", tokens),
        ):
            if value < 1:
                raise ValueError(f"speculative_{name} must be >= 1 (got {value})")
        if tokens < 2:
            raise ValueError(
                f"speculative_num_draft_tokens counts the root too and must be >= 2 (got {tokens})"
            )
        if algo not in MODEL_FREE:
            most = 1 + topk + (steps - 1) * topk * topk
            if tokens > most:
                raise ValueError(
                    f"speculative_num_draft_tokens {tokens} exceeds what {steps} steps of "
                    f"top-{topk} can draft ({most} with the root)"
                )
        # Merged trees are sized by hand: the planner learns acceptance of one drafter's tree.
        fixed = args.speculative_fixed_tree or args.speculative_hybrid_merge
        max_batch = args.speculative_max_batch_size
        if max_batch is None:
            max_batch = DEFAULT_FIXED_MAX_BATCH_SIZE if fixed else NO_LIMIT
        if max_batch < 0:
            raise ValueError(f"speculative_max_batch_size must be >= 0 (got {max_batch})")
        ngram_min = args.speculative_ngram_min_match_window_size or DEFAULT_NGRAM_MIN_MATCH
        ngram_max = args.speculative_ngram_max_match_window_size or max(
            DEFAULT_NGRAM_MAX_MATCH, ngram_min
        )
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(
                "need 1 <= speculative_ngram_min_match_window_size <= "
                f"speculative_ngram_max_match_window_size (got {ngram_min} and {ngram_max})"
            )
        hybrid = args.speculative_hybrid_ngram
        if hybrid is None:
            hybrid = DEFAULT_HYBRID_NGRAM if algo not in MODEL_FREE else 0
        if hybrid and algo in MODEL_FREE:
            raise ValueError(
                "--speculative-hybrid-ngram pairs n-gram drafts with a drafter's "
                f"(EAGLE, EAGLE3, STANDALONE or MEDUSA); {algo} drafts without one"
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
                "n-gram trees: it needs EAGLE, EAGLE3, STANDALONE or MEDUSA with "
                "--speculative-hybrid-ngram >= 2 (LOOKAHEAD alone: --speculative-algorithm "
                "LOOKAHEAD)"
            )
        cost_path = args.speculative_cost_model
        if cost_path is not None and fixed:
            raise ValueError(
                "--speculative-cost-model sizes trees by the planner; it does not go with "
                "--speculative-fixed-tree or --speculative-hybrid-merge (sized by hand)"
            )
        quant = (args.speculative_draft_quantization or "none").lower()
        if quant not in DRAFT_QUANTIZATIONS:
            raise ValueError(
                f"speculative_draft_quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)} "
                f"(got {quant!r})"
            )
        if quant == "auto":  # a head's float weights to 8 bits; a draft model's as stored
            quant = "none" if algo == "STANDALONE" else "q8_0"
        token_map = args.speculative_token_map
        if token_map is not None and algo != "STANDALONE":
            raise ValueError(
                "--speculative-token-map restricts a draft model's vocabulary: it goes with "
                f"--speculative-algorithm STANDALONE (got {algo})"
            )
        return cls(
            algo,
            steps,
            topk,
            tokens,
            path,
            max_batch,
            ngram_min,
            ngram_max,
            hybrid,
            merge,
            fixed,
            cost_path,
            grammar_drafts=not args.speculative_disable_grammar_drafts,
            draft_quantization=None if quant == "none" else quant.upper(),
            token_map=token_map,
            lookahead=lookahead_settings(args),
            hybrid_lookahead=hybrid_lookahead,
        )


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
