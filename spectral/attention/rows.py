"""Query rows over the paged KV cache, each row naming its keys: the first `seq_lens[t]` slots of
its req-to-token row `rows[t]`, then the slots of its own `tail[t]` (a draft tree's ancestors,
which live in scratch slots, not in the table). On a GPU one Triton kernel reads the table in
place (nothing waits for the device: a CUDA graph may hold it); on a CPU the rows are written
out as slot lists for spectral's decode-attention kernel, or gathered for SDPA without it.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F


def rows_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    tail: torch.Tensor | None = None,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """q [T, H, D] over pools [slots, KVH, D]; rows, seq_lens int64 [T] (seq_lens >= 1); tail
    int64 [T, M] or None. Returns [T, H, D] in q's dtype."""
    if q.is_cuda and _triton_available():
        from spectral.kernels.triton.attention import row_attention

        return row_attention(q, k_pool, v_pool, table, seq_lens, scaling, rows, tail)
    indices, lens = explicit_rows(table, rows, seq_lens, tail)
    if kernels is not None and q.device.type == "cpu" and k_pool.dtype in _KERNEL_DTYPES:
        out = kernels.decode_attention(
            q.to(k_pool.dtype).contiguous(), k_pool, v_pool, indices, lens, scaling
        )
        return out.to(q.dtype)
    return slot_list_attention(q, k_pool, v_pool, indices, lens, scaling)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def explicit_rows(
    table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, tail: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's slots written out: (indices [T, W] int64, lengths [T]); row t's first
    seq_lens[t] entries are its table row's, the next M its tail's, the rest slot 0."""
    width = int(seq_lens.max()) if seq_lens.numel() else 0
    extra = 0 if tail is None else tail.shape[1]
    indices = torch.zeros((rows.shape[0], width + extra), dtype=torch.int64, device=table.device)
    indices[:, :width] = table[rows, :width]
    columns = torch.arange(width, device=table.device)
    indices[:, :width].masked_fill_(columns[None, :] >= seq_lens[:, None], 0)
    if extra:
        places = seq_lens[:, None] + torch.arange(extra, device=table.device)[None, :]
        indices.scatter_(1, places, tail)
    return indices, seq_lens + extra


def slot_list_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Row t of q over the keys at indices[t, :lens[t]], by gathering them (SDPA, GQA)."""
    T, H, D = q.shape
    visible = torch.arange(indices.shape[1], device=q.device)[None, :] < lens[:, None]
    keys = k_pool[indices].transpose(1, 2)  # [T, KVH, W, D]
    values = v_pool[indices].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.to(keys.dtype)[:, :, None, :],
        keys,
        values,
        attn_mask=visible[:, None, None, :],
        scale=scaling,
        enable_gqa=True,
    )
    return out.view(T, H, D).to(q.dtype)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
