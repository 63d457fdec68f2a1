"""Req: one generation request and everything the scheduler tracks about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

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
    # KV state: the request's row in the req-to-token table and the slots it owns, in position
    # order. Owned from admission until `release`.
    req_pool_idx: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    # How many slots this request may still claim (reserved at admission).
    reserved_tokens: int = 0
    finished_reason: FinishReason | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Where a matched stop string starts in the decoded output text.
    stop_text_cut: int | None = None
    created_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None

    @property
    def seq_len(self) -> int:
        """Tokens whose KV is in the cache (prompt + outputs except the newest one)."""
        return len(self.kv_slots)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None
