"""`--attention-backend triton`: every forward mode through one Triton kernel over the paged
KV cache (`row_attention`: each new token a query row over the slots it may see). Runs on CUDA;
on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported:
slow, for tests)."""

from __future__ import annotations

import torch

from spectral.forward import ForwardBatch
from spectral.kernels.base import AttentionBackend, query_row_slots
from spectral.kernels.triton.attention import row_attention


class TritonAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = query_row_slots(batch, self.req_to_token.table)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        kv_indices, lens = batch.attn_metadata
        out = row_attention(
            q.to(self.kv_pool.dtype),
            self.kv_pool.k[layer_id],
            self.kv_pool.v[layer_id],
            kv_indices,
            lens,
            self.scaling,
        )
        return out.reshape(q.shape[0], -1).to(q.dtype)
