"""`--attention-backend triton`: DECODE through `row_attention` (each request's one new token a
query row over its slots), every other mode through `extend_attention` (tiles of new tokens
over the request's keys, causal or under the tree mask). Runs on CUDA; on CPU tensors only under
Triton's interpreter (TRITON_INTERPRET=1 before triton is imported: slow, for tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectral.attention.base import AttentionBackend, request_slots
from spectral.core.forward import ForwardBatch
from spectral.kernels.triton.attention import row_attention
from spectral.kernels.triton.extend import extend_attention


@dataclass
class RowMetadata:
    kv_indices: torch.Tensor  # [B, L] slots per request (its one query row)
    lens: torch.Tensor  # [T]


@dataclass
class ExtendMetadata:
    prefix_lens: torch.Tensor  # [B] int64, on the table's device
    extend_lens: torch.Tensor  # [B]


class TritonAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.table
        if batch.mode.is_decode():  # each request's one new token over its slots
            batch.attn_metadata = RowMetadata(*request_slots(batch, table))
            return
        batch.attn_metadata = ExtendMetadata(
            torch.tensor(batch.prefix_lens, dtype=torch.int64, device=table.device),
            torch.tensor(batch.extend_lens, dtype=torch.int64, device=table.device),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        meta = batch.attn_metadata
        dtype, q = q.dtype, q.to(self.kv_pool.dtype)
        k_pool, v_pool = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        if isinstance(meta, RowMetadata):
            out = row_attention(q, k_pool, v_pool, meta.kv_indices, meta.lens, self.scaling)
        else:
            out = extend_attention(
                q,
                k_pool,
                v_pool,
                self.req_to_token.table,
                batch.req_pool_indices,
                meta.prefix_lens,
                meta.extend_lens,
                self.scaling,
                batch.custom_mask,
            )
        return out.reshape(out.shape[0], -1).to(dtype)
