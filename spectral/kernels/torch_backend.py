"""Attention in plain PyTorch: gather K/V by slot index, then SDPA under an explicit mask.

This backend runs on any device and is the oracle the other backends are tested against. All
requests of a batch are padded to the longest one; the mask hides the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spectral.forward import ForwardBatch
from spectral.kernels.base import AttentionBackend


@dataclass
class TorchAttnMetadata:
    kv_indices: torch.Tensor  # [B, max_seq_len] slots, padding → dummy slot 0
    seq_lens: torch.Tensor  # [B] int64
    mask: torch.Tensor | None  # [B, 1, max_extend, max_seq_len] bool, True = attend
    # Row of each real token in the padded [B * max_extend] query layout; None if no padding.
    query_rows: torch.Tensor | None
    max_extend: int


def build_attention_mask(batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """[B, 1, max_extend, max_seq_len] bool: query q of request b may attend to key j.

    Keys j < prefix_len are always visible. Among the new tokens, causal modes see those at or
    before themselves; custom-mask modes see what their row of `custom_mask` allows. Padded query
    rows see every key (their outputs are dropped; this keeps them finite).
    """
    prefix_lens, extend_lens = batch.prefix_lens, batch.extend_lens
    max_extend = max(extend_lens)
    max_seq = max(batch.seq_lens)
    bsz = batch.batch_size
    mask = torch.zeros((bsz, max_extend, max_seq), dtype=torch.bool, device=device)
    custom = batch.custom_mask
    offset = 0
    for b, (prefix, ext) in enumerate(zip(prefix_lens, extend_lens)):
        mask[b, :ext, :prefix] = True
        if custom is None:
            mask[b, :ext, prefix : prefix + ext] = torch.ones(
                (ext, ext), dtype=torch.bool, device=device
            ).tril()
        else:
            mask[b, :ext, prefix : prefix + ext] = custom[offset : offset + ext * ext].view(
                ext, ext
            )
            offset += ext * ext
        mask[b, ext:, :] = True
    return mask.unsqueeze(1)


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.req_to_token.table.device
        seq_lens = batch.seq_lens
        max_seq = max(seq_lens)
        max_extend = max(batch.extend_lens)
        kv_indices = self.req_to_token.table[batch.req_pool_indices, :max_seq]
        lens = torch.tensor(seq_lens, device=device)
        if min(seq_lens) != max_seq:
            pad = torch.arange(max_seq, device=device)[None, :] >= lens[:, None]
            kv_indices = kv_indices.masked_fill(pad, 0)

        if self._use_decode_kernel(batch):
            batch.attn_metadata = TorchAttnMetadata(kv_indices, lens, None, None, 1)
            return
        single_decode = batch.batch_size == 1 and max_extend == 1
        mask = None if single_decode else build_attention_mask(batch, device)

        query_rows = None
        if min(batch.extend_lens) != max_extend:
            query_rows = torch.cat(
                [
                    torch.arange(ext, device=device) + b * max_extend
                    for b, ext in enumerate(batch.extend_lens)
                ]
            )
        batch.attn_metadata = TorchAttnMetadata(kv_indices, lens, mask, query_rows, max_extend)

    def _use_decode_kernel(self, batch: ForwardBatch) -> bool:
        return (
            self.kernels is not None
            and batch.mode.is_decode()
            and self.kv_pool.k[0].device.type == "cpu"
            and self.kv_pool.dtype in (torch.float32, torch.bfloat16)
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: TorchAttnMetadata = batch.attn_metadata
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)

        bsz, num_heads, head_dim = batch.batch_size, q.shape[1], q.shape[2]
        if meta.mask is None and self._use_decode_kernel(batch):
            out = self.kernels.decode_attention(
                q.to(self.kv_pool.dtype),
                self.kv_pool.k[layer_id],
                self.kv_pool.v[layer_id],
                meta.kv_indices,
                meta.seq_lens,
                self.scaling,
            )
            return out.view(bsz, num_heads * head_dim).to(q.dtype)
        if meta.query_rows is None:
            q_pad = q.view(bsz, meta.max_extend, num_heads, head_dim)
        else:
            q_pad = q.new_zeros((bsz * meta.max_extend, num_heads, head_dim))
            q_pad[meta.query_rows] = q
            q_pad = q_pad.view(bsz, meta.max_extend, num_heads, head_dim)

        keys = self.kv_pool.k[layer_id][meta.kv_indices].transpose(1, 2)
        values = self.kv_pool.v[layer_id][meta.kv_indices].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2).to(keys.dtype),
            keys,
            values,
            attn_mask=meta.mask,
            scale=self.scaling,
            enable_gqa=True,
        )
        out = out.transpose(1, 2).reshape(bsz * meta.max_extend, num_heads * head_dim)
        if meta.query_rows is not None:
            out = out[meta.query_rows]
        return out.to(q.dtype)
