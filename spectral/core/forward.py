"""The nouns of one model forward: its mode and the batch the worker runs.

Every layer below the scheduler (worker, model, attention backends) reads a `ForwardBatch`;
nothing else is passed between them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the server's torch-free processes import ForwardMode
    import torch


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()  # prefill of new tokens on top of a cached prefix (causal)
    DECODE = enum.auto()  # one new token per request
    TARGET_VERIFY = enum.auto()  # a token tree per request under a custom mask
    DRAFT_EXTEND = enum.auto()  # draft model over accepted tokens (causal)
    DRAFT_DECODE = enum.auto()  # draft model expanding tree nodes (custom mask)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def uses_custom_mask(self) -> bool:
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE)


@dataclass
class ForwardBatch:
    """One forward over `batch_size` requests, tokens laid out request after request.

    Request i contributes `extend_lens[i]` new tokens that follow `prefix_lens[i]` tokens already
    in the KV cache; its row `req_pool_indices[i]` of the req-to-token table holds the slots of
    all `prefix_lens[i] + extend_lens[i]` tokens (the new ones at `out_cache_loc`) by the time
    the attention backend runs.

    `custom_mask`, for the custom-mask modes, is the concatenation over requests of a flattened
    bool matrix `[extend_len, extend_len]`: entry (q, k) says whether new token q may attend to new
    token k. The prefix is always fully visible. In the causal modes it is None.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots the new tokens are written to
    req_pool_indices: torch.Tensor  # [batch_size] int64
    prefix_lens: list[int]
    extend_lens: list[int]
    custom_mask: torch.Tensor | None = None
    # Which rows get logits: "last" (the last token of each request) or "all".
    logits_rows: str = "last"
    # Layer indices whose input hidden states are returned (EAGLE-3 uses three).
    capture_layers: tuple[int, ...] = ()
    attn_metadata: object = field(default=None, repr=False)
    # The device copy of `seq_lens` where the batch lives in static buffers (a CUDA graph's,
    # spectral.worker.graph_runner): backends build their metadata from it inside the graph.
    seq_lens_tensor: torch.Tensor | None = None
    # `req_pool_indices` on the host, where whoever built the batch knew them (read there
    # without waiting for the device).
    rows_host: list[int] | None = None

    def host_rows(self) -> list[int]:
        """The table rows on the host (a device read where the builder did not give them)."""
        return self.rows_host if self.rows_host is not None else self.req_pool_indices.tolist()

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
