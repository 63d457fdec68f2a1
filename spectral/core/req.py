"""A generation request: what a client asked for (`TokenizedRequest`, the message the server's
processes pass) and everything the scheduler tracks about it while it runs (`Req`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

from spectral.mem.radix_cache import TreeNode
from spectral.sampling_params import InvalidRequestError, SamplingParams


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        if self.message:
            out["message"] = self.message
        return out


@dataclass
class SpecState:
    """A request's speculative decoding, kept by the scheduler's SpecRound."""

    # This round's tree: one slot per node (node 0 = the root), and the nodes when the
    # scheduler drafts them (n-gram, grammar-forced; None: the worker's head drafts).
    slots: list[int] = field(default_factory=list)
    draft_tokens: list[int] | None = None
    draft_parents: list[int] | None = None
    ngram: Any = None  # the n-gram drafter's state for this request
    lookahead: Any = None  # LOOKAHEAD's window and pool for this request
    # The tree planner's view: which statistics this round's tree counts in, the accepted
    # drafts against what they expected, the head's confidence in its next draft (if known).
    kind: str = ""
    expected_drafts: float = 0.0
    draft_top1: float | None = None
    # Its length when the worker's drafter last drafted its tree: a draft model computes its KV
    # from there before it drafts again (the planner charges that catch-up).
    draft_synced: int = 0
    verify_ct: int = 0  # rounds, and the draft tokens they accepted (meta_info)
    accepted_tokens: int = 0

    def meta(self) -> dict[str, Any]:
        """meta_info entries (none for a request that never ran a round): rounds, accepted
        draft tokens, and tokens per round."""
        if not self.verify_ct:
            return {}
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_accept_length": (self.verify_ct + self.accepted_tokens) / self.verify_ct,
        }


@dataclass
class TokenizedRequest:
    """A tokenized request, as the tokenizer manager sends it to the scheduler."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # With return_logprob: logprobs of the prompt tokens from this position on (-1: the last
    # prompt token only, which has none, as in SGLang).
    logprob_start_len: int = -1
    # Requests of one client call (a batch, n choices) share a group; the scheduler shares
    # its rows fairly between groups. None: a group of its own.
    group: str | None = None
    # Whether the client takes the output as it comes (else it gets it all when finished).
    stream: bool = True


@dataclass
class Req(TokenizedRequest):
    """A request in the scheduler: its output so far, its KV and its speculative state."""

    output_ids: list[int] = field(default_factory=list)

    # KV state, owned from admission until the scheduler releases the request:
    # `kv_slots[p]` holds the KV of token p; the first `protected_len` of them belong to the
    # radix tree (kept alive by the lock on `last_node`), the rest to this request.
    req_pool_idx: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    protected_len: int = 0
    last_node: TreeNode | None = None
    # Slots it holds for its next tokens (KVManager.take), lowest first; in no other place.
    kv_spare: list[int] = field(default_factory=list)
    # Lowest position whose slot the worker's req-to-token row may not hold yet.
    table_stale_from: int | None = None
    # This round's prefill: tokens [extend_start, extend_start + extend_len) of all_ids.
    extend_start: int = 0
    extend_len: int = 0

    finished_reason: FinishReason | None = None
    cached_tokens: int = 0
    retraction_count: int = 0
    input_logprobs: list[float | None] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    spec: SpecState = field(default_factory=lambda: SpecState())
    # Where a matched stop string starts in the decoded output text.
    stop_text_cut: int | None = None
    # Structured output: the request's place in its grammar (spectral.constrained.Grammar),
    # always exactly its committed output.
    grammar: Any = None
    created_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None

    @property
    def group_key(self) -> str:
        return self.group if self.group is not None else self.rid

    @property
    def seq_len(self) -> int:
        """Tokens whose KV is in the cache."""
        return len(self.kv_slots)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def num_ids(self) -> int:
        """len(all_ids), without building all_ids."""
        return len(self.input_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (the decode step asks for one token)."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.output_ids

    def cacheable_prefix(self, tokens: list[int]) -> list[int]:
        """The part of `tokens` that may come from the radix cache: all but the last token,
        and nothing from `logprob_start_len` on while input logprobs are wanted."""
        end = len(tokens) - 1
        if self.wants_input_logprobs:
            end = min(end, self.logprob_start_len)
        return tokens[:end]

    @classmethod
    def of(cls, request: TokenizedRequest) -> Req:
        """The scheduler's state for a request received from the tokenizer manager."""
        return cls(**{f.name: getattr(request, f.name) for f in fields(TokenizedRequest)})

    def __post_init__(self) -> None:
        if self.return_logprob and self.logprob_start_len < 0:
            self.logprob_start_len = len(self.input_ids) - 1

    def input_token_logprobs(self) -> list[tuple[float | None, int]]:
        """(logprob, token) for the prompt from `logprob_start_len` on; the first has no
        logprob."""
        start = min(self.logprob_start_len, len(self.input_ids) - 1)
        return list(zip(self.input_logprobs, self.input_ids[start:]))

    def usage(self) -> dict[str, Any]:
        """Its token counts and speculation figures, as every output reports them."""
        return {
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            **self.spec.meta(),
        }

    def remaining_new_tokens(self, max_output: int) -> int:
        return max(max_output - len(self.output_ids), 0)


def check_request(
    input_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_context_len: int,
    num_kv_slots: int,
    logprob_start_len: int = -1,
) -> None:
    """Raise InvalidRequestError for a request that can never run: an empty or too long
    prompt, ids outside the vocabulary, parameters out of range, more KV than the pool has,
    prompt logprobs asked from past the prompt's end. The scheduler checks every request; the
    server checks before it queues one too."""
    n = len(input_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty: give a non-empty text or input_ids")
    if logprob_start_len >= n:
        raise InvalidRequestError(
            f"logprob_start_len: {logprob_start_len} is not below the prompt's {n} tokens",
            "logprob_start_len",
        )
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"input_ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})", "input_ids"
        )
    if n >= max_context_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens; the context length is {max_context_len}, "
            f"so prompts may have at most {max_context_len - 1}"
        )
    params.validate(vocab_size)
    needed = n + min(params.max_new_tokens, max_context_len - n)
    if needed > num_kv_slots:
        raise InvalidRequestError(
            f"the request needs {needed} tokens of KV cache (prompt {n} + max_new_tokens), "
            f"the pool holds {num_kv_slots}; lower max_new_tokens or raise --max-total-tokens",
            "max_new_tokens",
        )
