"""Req: one generation request and everything the scheduler tracks about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from spectral.mem.radix_cache import TreeNode
from spectral.sampling_params import SamplingParams


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
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)

    # KV state, owned from admission until the scheduler releases the request:
    # `kv_slots[p]` holds the KV of token p; the first `protected_len` of them belong to the
    # radix tree (kept alive by the lock on `last_node`), the rest to this request.
    req_pool_idx: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    protected_len: int = 0
    last_node: TreeNode | None = None
    # Lowest position whose slot the worker's req-to-token row may not hold yet.
    table_stale_from: int | None = None
    # This round's prefill: tokens [extend_start, extend_start + extend_len) of all_ids.
    extend_start: int = 0
    extend_len: int = 0

    finished_reason: FinishReason | None = None
    cached_tokens: int = 0
    retraction_count: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Where a matched stop string starts in the decoded output text.
    stop_text_cut: int | None = None
    created_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None

    @property
    def seq_len(self) -> int:
        """Tokens whose KV is in the cache."""
        return len(self.kv_slots)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def is_prefilling(self) -> bool:
        """Admitted, but the KV of some prompt (or re-prefill) tokens is still to compute."""
        return self.req_pool_idx is not None and self.seq_len < len(self.input_ids) + len(
            self.output_ids
        )

    def remaining_new_tokens(self, max_output: int) -> int:
        return max(max_output - len(self.output_ids), 0)
