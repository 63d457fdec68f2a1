"""Attention of many new tokens per request, in tiles: prefill over a cached prefix (causal) and
draft-tree verification (a custom mask among the new tokens).

One program per (request, head, block of BLOCK_M new tokens) holds its queries in a tile and
streams the request's keys from the req-to-token table in blocks of BLOCK_N, so each key block
is read once per query block instead of once per query (what `row_attention` does, which
suits one query per request). Scores and values go through `tl.dot`; the softmax is online, in
float32. A key is visible to new token i when it is in the prefix, or it is new token j with
j <= i (causal) or mask[i, j] (custom). Causal blocks stop at their last query's position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spectral.kernels.triton.attention import launch_layout

BLOCK_M = 16
BLOCK_N = 32
# A finite floor: a row with no visible key in a block keeps weight 0, no NaN. A kernel reads
# a module global only as a tl.constexpr (tests/test_triton_compile.py).
MASKED = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b, in full float32 precision where IEEE (float32 inputs), else tl.dot's default."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _masked_scores(
    q,
    k,
    scale,
    m,
    m_ok,
    n,
    n_ok,
    prefix,
    num_new,
    mask_row,
    CUSTOM_MASK: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Scaled float32 scores of queries m (new tokens) against keys n (table positions), -inf
    where a key is not visible: past the block's end, or a new token after m (causal) or not
    set in m's row of the request's mask bits `mask_row` (custom); prefix keys are visible to
    all."""
    scores = _dot(q, tl.trans(k), IEEE).to(tl.float32) * scale
    j = n - prefix  # index among the new tokens (negative in the prefix)
    if CUSTOM_MASK:
        among_new = j >= 0
        bits = tl.load(
            mask_row + m[:, None] * num_new + j[None, :],
            mask=m_ok[:, None] & among_new[None, :] & n_ok[None, :],
            other=0,
        )
        visible = (~among_new[None, :] | (bits != 0)) & n_ok[None, :]
    else:
        visible = (j[None, :] <= m[:, None]) & n_ok[None, :]
    return tl.where(visible, scores, float("-inf"))


@triton.jit
def _online_softmax_step(scores, v_ptrs, kv_ok, acc, total, best, IEEE: tl.constexpr):
    """One key block's step of the online softmax: the row maxima `best`, the sums of weights
    `total` and the weighted values `acc` rescaled to the new maxima, then the block's values
    (loaded from `v_ptrs`) added. Returns (acc, total, best)."""
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    weights = tl.exp(scores - new_best[:, None])
    rescale = tl.exp(best - new_best)
    v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
    total = total * rescale + tl.sum(weights, axis=1)
    update = _dot(weights.to(v.dtype), v, IEEE)
    acc = acc * rescale[:, None] + update.to(tl.float32)
    return acc, total, new_best


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    rows_ptr,
    prefix_ptr,
    new_ptr,
    q_start_ptr,
    mask_ptr,
    mask_start_ptr,
    out_ptr,
    scale,
    stride_table,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CUSTOM_MASK: tl.constexpr,
    IEEE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    num_new = tl.load(new_ptr + req)
    if block * BLOCK_M >= num_new:
        return
    prefix = tl.load(prefix_ptr + req)
    row = tl.load(rows_ptr + req)
    q_start = tl.load(q_start_ptr + req)
    kv_head = head // GROUP

    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < num_new
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    best = tl.full([BLOCK_M], MASKED, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CUSTOM_MASK:
        end = prefix + num_new
        mask_row = mask_ptr + tl.load(mask_start_ptr + req)  # the request's mask bits
    else:
        end = tl.minimum(prefix + num_new, prefix + (block + 1) * BLOCK_M)
        mask_row = mask_ptr  # not read
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        slots = tl.load(table_ptr + row * stride_table + n, mask=n_ok, other=0)
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
            mask=kv_ok,
            other=0.0,
        )
        scores = _masked_scores(
            q, k, scale, m, m_ok, n, n_ok, prefix, num_new, mask_row, CUSTOM_MASK, IEEE
        )
        v_ptrs = v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        acc, total, best = _online_softmax_step(scores, v_ptrs, kv_ok, acc, total, best, IEEE)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # padding rows may see no key
    tl.store(
        out_ptr + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


@dataclass(frozen=True)
class ExtendLayout:
    """Where each request's new tokens, keys and mask bits are, for `extend_attention`: B
    requests, request b's `extend_lens[b]` new tokens (query rows from `q_starts[b]`) after
    `prefix_lens[b]` cached ones, its slots (prefix, then new) in table row `rows[b]`; with a
    custom mask, its bits from `mask_starts[b]` of `mask` (int8). All int64 [B] on the device;
    `max_extend` (a host int) sizes the grid. Built once a forward, read by every layer."""

    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    q_starts: torch.Tensor
    max_extend: int
    mask: torch.Tensor | None = None
    mask_starts: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        max_extend: int,
        custom_mask: torch.Tensor | None = None,
    ) -> ExtendLayout:
        """From the requests' table rows, prefix and new-token counts (device tensors) and
        ForwardBatch's flattened bool mask; nothing read back to the host."""
        zero = torch.zeros(1, dtype=torch.int64, device=extend_lens.device)
        q_starts = torch.cat((zero, extend_lens.cumsum(0)[:-1]))
        mask = mask_starts = None
        if custom_mask is not None:
            mask = custom_mask.to(torch.int8)
            mask_starts = torch.cat((zero, (extend_lens * extend_lens).cumsum(0)[:-1]))
        return cls(rows, prefix_lens, extend_lens, q_starts, max_extend, mask, mask_starts)


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    layout: ExtendLayout,
    scaling: float,
) -> torch.Tensor:
    """q [T, H, D]: the new tokens of the requests `layout` describes, request after request,
    their slots in `table` (the req-to-token table); causal among a request's new tokens, or
    under `layout.mask`. Returns [T, H, D] in q's dtype. Reads no device value on the host (a
    CUDA graph may hold it)."""
    T, H, _ = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if T == 0:
        return out
    mask = layout.mask if layout.mask is not None else layout.q_starts
    mask_starts = layout.mask_starts if layout.mask_starts is not None else layout.q_starts
    strides, shapes = launch_layout(q, k_pool, v_pool, out)
    grid = (layout.extend_lens.numel(), H, triton.cdiv(layout.max_extend, BLOCK_M))
    _extend_kernel[grid](
        q,
        k_pool,
        v_pool,
        table,
        layout.rows,
        layout.prefix_lens,
        layout.extend_lens,
        layout.q_starts,
        mask,
        mask_starts,
        out,
        scaling,
        table.stride(0),
        *strides,
        **shapes,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        CUSTOM_MASK=layout.mask is not None,
        IEEE=q.dtype == torch.float32,
    )
    return out
