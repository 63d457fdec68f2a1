"""Attention in plain PyTorch, on any device: per request (no work spent on padding), gather
its K/V by slot and run SDPA under an explicit mask. The oracle the other backends are tested
against. With spectral's CPU kernels, every batch goes through the decode-attention kernel
instead (a decode token, a prefill token or a tree token: a query row over the keys it sees),
whose rows do not depend on how a prompt is split into batches or which rows share one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from spectral.attention.base import (
    AttentionBackend,
    DecodeKernelInputs,
    request_mask,
    request_slots,
)
from spectral.core.forward import ForwardBatch


@dataclass
class RequestAttention:
    token_start: int  # first row of this request's new tokens in the batch
    num_new: int
    slots: torch.Tensor  # [seq_len] KV slots of every token the request attends to
    mask: torch.Tensor | None  # [num_new, seq_len] bool (True = attend); None = see all keys
    causal: bool  # no prefix and a plain causal mask: SDPA's own causal path


@dataclass
class TorchAttnMetadata:
    requests: list[RequestAttention]
    # For the decode kernel: [B, max_seq_len] slots (padding → dummy slot 0) and lengths; for
    # prefill rows, each request's number of new tokens too.
    kv_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None


def query_row_slots(batch: ForwardBatch, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every new token as a query row over the KV slots it attends to: its request's prefix,
    then the new tokens its mask lets it see (causal without a custom mask; in a tree, its
    ancestors and itself), packed to the front of its row. Returns (kv_indices [T, L] int64,
    lens [T]); entries past a row's length are slot 0. For the decode kernel, whose table is
    on the CPU: built in NumPy, a few operations a request (torch's cost a call is most of
    the work of a tree's few rows)."""
    slots_of = table.numpy()
    mask = None if batch.custom_mask is None else batch.custom_mask.numpy()
    width = max(p + n for p, n in zip(batch.prefix_lens, batch.extend_lens))
    kv_indices = np.zeros((sum(batch.extend_lens), width), dtype=np.int64)
    lens = np.empty(len(kv_indices), dtype=np.int64)
    start = mask_offset = 0
    for row, prefix, n in zip(batch.host_rows(), batch.prefix_lens, batch.extend_lens):
        if mask is not None:
            visible = mask[mask_offset : mask_offset + n * n].reshape(n, n)
            mask_offset += n * n
        else:
            visible = np.tri(n, dtype=bool)
        slots = slots_of[row, : prefix + n]
        block = kv_indices[start : start + n]
        block[:, :prefix] = slots[:prefix]
        count = visible.sum(axis=1)
        first = np.argsort(~visible, axis=1, kind="stable")  # the visible ones, in order
        block[:, prefix : prefix + n] = np.where(
            np.arange(n) < count[:, None], slots[prefix:][first], 0
        )
        lens[start : start + n] = prefix + count
        start += n
    return torch.from_numpy(kv_indices), torch.from_numpy(lens)


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if self._has_decode_kernel:
            if batch.custom_mask is not None:
                batch.attn_metadata = self._tree_metadata(batch)
            else:  # each request's new tokens (one in a decode step), causal over its slots
                extend_lens = torch.tensor(batch.extend_lens, dtype=torch.int64)
                batch.attn_metadata = TorchAttnMetadata(
                    [], *request_slots(batch, self.req_to_token.table), extend_lens
                )
            return
        device = self.req_to_token.table.device
        rows = batch.req_pool_indices.tolist()
        requests = []
        token_start = mask_offset = 0
        for row, prefix, num_new in zip(rows, batch.prefix_lens, batch.extend_lens):
            custom = None
            if batch.custom_mask is not None:
                flat = batch.custom_mask[mask_offset : mask_offset + num_new * num_new]
                custom = flat.view(num_new, num_new)
                mask_offset += num_new * num_new
            causal = custom is None and prefix == 0 and num_new > 1
            if causal or (num_new == 1 and custom is None):
                mask = None
            else:
                mask = request_mask(prefix, num_new, custom, device)
            slots = self.req_to_token.table[row, : prefix + num_new]
            requests.append(RequestAttention(token_start, num_new, slots, mask, causal))
            token_start += num_new
        batch.attn_metadata = TorchAttnMetadata(requests)

    @property
    def _has_decode_kernel(self) -> bool:
        """The CPU kernels are loaded and the KV pool is one they read."""
        return (
            self.kernels is not None
            and self.kv_pool.k[0].device.type == "cpu"
            and self.kv_pool.dtype in (torch.float32, torch.bfloat16)
        )

    def _tree_metadata(self, batch: ForwardBatch) -> TorchAttnMetadata:
        """Tree tokens through the decode kernel: each token is a query row whose keys are
        its request's prefix and its own ancestors in the tree (itself included). No K/V is
        gathered or copied."""
        return TorchAttnMetadata([], *query_row_slots(batch, self.req_to_token.table))

    def decode_kernel_inputs(self, batch: ForwardBatch) -> DecodeKernelInputs | None:
        meta: TorchAttnMetadata = batch.attn_metadata
        if meta.kv_indices is None:
            return None
        return DecodeKernelInputs(
            meta.kv_indices, meta.seq_lens, self.kv_pool, self.scaling, meta.extend_lens
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: TorchAttnMetadata = batch.attn_metadata
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        num_tokens, num_heads, head_dim = q.shape
        if meta.kv_indices is not None:
            out = self.kernels.decode_attention(
                q.to(self.kv_pool.dtype),
                self.kv_pool.k[layer_id],
                self.kv_pool.v[layer_id],
                meta.kv_indices,
                meta.seq_lens,
                self.scaling,
                meta.extend_lens,
            )
            return out.view(num_tokens, num_heads * head_dim).to(q.dtype)

        k_buf, v_buf = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        out = q.new_empty((num_tokens, num_heads * head_dim))
        for r in meta.requests:
            q_r = q[r.token_start : r.token_start + r.num_new].transpose(0, 1).to(k_buf.dtype)
            keys = k_buf[r.slots].transpose(0, 1)
            values = v_buf[r.slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q_r[None],
                keys[None],
                values[None],
                attn_mask=r.mask,
                is_causal=r.causal,
                scale=self.scaling,
                enable_gqa=True,
            )
            out[r.token_start : r.token_start + r.num_new] = (
                o[0].transpose(0, 1).reshape(r.num_new, num_heads * head_dim).to(q.dtype)
            )
        return out
