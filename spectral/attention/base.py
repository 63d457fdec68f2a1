"""The attention backend interface every model layer calls."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType

import torch

from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool


class AttentionBackend(ABC):
    """Attention over the paged KV cache for every forward mode.

    `init_forward_metadata` runs once per forward, before the first layer; `forward` runs once per
    layer and writes the new tokens' K and V into the pool before attending.
    """

    # The modes in which `init_forward_metadata` and `forward` over a batch in static buffers
    # (its `seq_lens_tensor` set, every request with one count of new tokens) may be captured
    # in a CUDA graph: no device value read on the host, no shape taken from one.
    capturable_modes: frozenset[ForwardMode] = frozenset()

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        scaling: float,
        kernels: ModuleType | None = None,
    ) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.scaling = scaling
        self.kernels = kernels

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build whatever the per-layer calls share (indices, masks) and store it on `batch`."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the batch's new tokens. Returns [T, H * D]."""

    def kv_store(
        self, layer_id: int, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where the layer may write its new tokens' K and V itself (a fused kernel) and then
        `attend`: the layer's K and V pools and the tokens' slots; None (the default) where
        `forward` writes them."""
        return None

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """`forward` once the new tokens' K and V are in the pool (backends with `kv_store`)."""
        raise NotImplementedError(f"{type(self).__name__} writes K and V in forward")

    def prepare_replay(self, batch: ForwardBatch) -> None:
        """Host work due before a captured forward of `batch` replays (a plan the graph's
        kernels read from buffers of fixed address); none by default."""
        return None

    def decode_kernel_inputs(self, batch: ForwardBatch) -> DecodeKernelInputs | None:
        """Where this forward's attention is the CPU kernels' decode_attention over the KV pool
        (which a fused decoder layer can then run itself), what it reads; else None."""
        return None


class StoreThenAttend(AttentionBackend):
    """A backend that writes the new tokens' K and V into the pool, then `attend`s over the
    pool: a layer may write them itself (`kv_store`: a fused rotation and store on a GPU)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        return self.attend(q, layer_id, batch)

    def kv_store(
        self, layer_id: int, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kv_pool.k[layer_id], self.kv_pool.v[layer_id], batch.out_cache_loc

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass(frozen=True)
class DecodeKernelInputs:
    """What decode_attention reads, besides each layer's q: every new token's row of KV slots
    (`kv_indices` [T, L], valid up to `seq_lens` [T]), or, with `extend_lens` [B], each
    request's row of slots (`kv_indices` [B, L]) whose last `extend_lens` new tokens are query
    rows over the keys up to their own; the pool and the softmax scale."""

    kv_indices: torch.Tensor
    seq_lens: torch.Tensor
    kv_pool: KVPool
    scaling: float
    extend_lens: torch.Tensor | None = None


def request_mask(
    prefix: int, num_new: int, custom: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[num_new, prefix + num_new] bool: every prefix key is visible; among the new tokens,
    causal when `custom` is None, else what `custom` ([num_new, num_new]) allows."""
    mask = torch.ones((num_new, prefix + num_new), dtype=torch.bool, device=device)
    if custom is None:
        mask[:, prefix:] = torch.ones((num_new, num_new), dtype=torch.bool, device=device).tril()
    else:
        mask[:, prefix:] = custom
    return mask


def request_slots(batch: ForwardBatch, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's KV slots, prefix and new tokens (its row of the req-to-token table up to
    its length), as ([B, longest] int64 with slot 0 past a request's length, lengths [B])."""
    seq_lens = batch.seq_lens
    width = max(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=table.device)
    slots = table[batch.req_pool_indices.to(table.device), :width]
    if min(seq_lens) != width:
        past = torch.arange(width, device=table.device)[None, :] >= lens[:, None]
        slots = slots.masked_fill(past, 0)
    return slots, lens
