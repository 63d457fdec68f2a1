"""What the scheduler sends the worker each step, and what comes back. Plain lists (and the
vocabulary mask as a tensor, which travels as a raw frame), so a message encodes without pickle
when the worker lives in another process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spectral.core.forward import ForwardMode
from spectral.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


# Plain decode steps out at once when launched ahead (DecodePipeline): the one the device runs,
# and the next.
MAX_LAUNCHED = 2


@dataclass
class RequestSampling:
    """Sampling state of one request for one step."""

    params: SamplingParams
    rid: str = ""  # for error messages (and test fault injection)
    # Tokens generated so far: the step index that seeds a seeded request, and the counts that
    # frequency/presence penalties use. `penalty_prompt_ids` only when a repetition penalty is on.
    output_ids: list[int] = field(default_factory=list)
    penalty_prompt_ids: list[int] = field(default_factory=list)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Tokens that may not be sampled this step (EOS and stop ids before `min_new_tokens`).
    banned_token_ids: list[int] = field(default_factory=list)


@dataclass
class WorkerBatch:
    """One forward. Request i writes `out_cache_loc` for its `extend_lens[i]` new tokens at
    positions `prefix_lens[i]...` of table row `req_pool_indices[i]`; `table_writes` first
    records prefix slots that the row does not hold yet (row, start position, slots)."""

    mode: ForwardMode
    input_ids: list[int]
    positions: list[int]
    out_cache_loc: list[int]
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    sampling: list[RequestSampling]
    table_writes: list[tuple[int, int, list[int]]] = field(default_factory=list)
    custom_mask: list[bool] | None = None
    # Per request (EXTEND only): first position whose next-token logprob is wanted, or -1.
    input_logprob_starts: list[int] = field(default_factory=list)
    # The input token after the batch's last position of each request (-1: none), so that the
    # last row of a prefill chunk scores it.
    input_logprob_next: list[int] = field(default_factory=list)
    # Speculative decoding. EXTEND with a draft head: per request, the token after the batch's
    # last position when it is known (a prompt chunk), else -1 (the sampled token follows).
    draft_next_ids: list[int] = field(default_factory=list)
    # The drafter idles this step (`SpecRound.head_idle`): no upkeep asked of it (a prompt
    # prefilled or a round's accepted tokens while it idles are not given to it either).
    drafter_idle: bool = False
    # TARGET_VERIFY: `input_ids` holds each request's root (its last token) and `extend_lens`
    # the tree sizes; trees come from the worker's draft head, or are given here (n-gram):
    # non-root node tokens and parents (0 = root, i + 1 = node i), per request, None for a
    # request the head drafts for.
    draft_tokens: list[list[int] | None] | None = None
    draft_parents: list[list[int] | None] | None = None
    # Structured output: per request, a bitmask of the tokens its grammar allows next (32 to an
    # int32; -1 rows allow all), or None when no request has a grammar.
    vocab_mask: torch.Tensor | None = None


@dataclass
class WorkerResult:
    next_token_ids: list[int]
    # Per request, when asked for: logprob of the chosen token, and the top-k (logprob, id) pairs.
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None]
    # Per request, with input_logprob_starts: logprob of each following input token.
    input_logprobs: list[list[float]] = field(default_factory=list)
    # TARGET_VERIFY: per request, the accepted tree nodes (root first; their slots keep the
    # KV) and the tokens to append (one per accepted node: the accepted drafts, then the
    # target's own next token), with their logprobs when asked for.
    accepted_nodes: list[list[int]] = field(default_factory=list)
    emitted_ids: list[list[int]] = field(default_factory=list)
    emitted_logprobs: list[list[float] | None] = field(default_factory=list)
    emitted_top_logprobs: list[list[list[tuple[float, int]]] | None] = field(default_factory=list)
    # TARGET_VERIFY: per request, each node's rank by the drafter's confidence (-1 the root),
    # and where the head drafted, its candidates' probabilities, best first (the tree planner
    # learns acceptance by rank from them).
    node_ranks: list[list[int]] = field(default_factory=list)
    draft_probs: list[list[float] | None] = field(default_factory=list)
    # With a draft head: per request, the head's top-1 probability after its last verified
    # token (None where not known), the confidence the planner sizes its next tree by.
    draft_top1: list[float | None] = field(default_factory=list)
    # TARGET_VERIFY: per request, the target's greedy choice after each tree node (root first),
    # on the logits verification used (LOOKAHEAD's Jacobi iterations read them).
    node_next_ids: list[list[int]] = field(default_factory=list)
