"""`--attention-backend triton`: DECODE through `row_attention` (each request's one new token a
query row over its row of the req-to-token table), every other mode through `extend_attention`
(tiles of new tokens over the request's keys, causal or under the tree mask). Runs on CUDA; on
CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported:
slow, for tests). Its metadata is built on the device from the batch's tensors and host sizes
alone, so a forward over static buffers can be captured in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectral.attention.base import StoreThenAttend
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.transfer import on_device
from spectral.kernels.triton.attention import row_attention
from spectral.kernels.triton.extend import ExtendLayout, extend_attention


@dataclass
class RowMetadata:
    rows: torch.Tensor  # [B] each request's row of the req-to-token table
    lens: torch.Tensor  # [B] its length, the new token included


class TritonAttentionBackend(StoreThenAttend):
    capturable_modes = frozenset((ForwardMode.DECODE, ForwardMode.TARGET_VERIFY))

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.req_to_token.table.device
        seq_lens = batch.seq_lens_tensor
        if seq_lens is None:
            seq_lens = on_device(batch.seq_lens, torch.int64, device)
        rows = batch.req_pool_indices
        if batch.mode.is_decode():
            batch.attn_metadata = RowMetadata(rows, seq_lens)
            return
        if batch.seq_lens_tensor is not None:  # static buffers: one count for every request
            new = torch.full_like(seq_lens, batch.extend_lens[0])
        else:
            new = on_device(batch.extend_lens, torch.int64, device)
        batch.attn_metadata = ExtendLayout.build(
            rows, seq_lens - new, new, max(batch.extend_lens), batch.custom_mask
        )

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        meta = batch.attn_metadata
        dtype, q = q.dtype, q.to(self.kv_pool.dtype)
        k_pool, v_pool = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        table = self.req_to_token.table
        if isinstance(meta, RowMetadata):
            out = row_attention(q, k_pool, v_pool, table, meta.lens, self.scaling, meta.rows)
        else:
            out = extend_attention(q, k_pool, v_pool, table, meta, self.scaling)
        return out.reshape(out.shape[0], -1).to(dtype)
