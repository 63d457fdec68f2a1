"""Attention over the paged KV cache, one query row at a time: query row t attends to the KV
slots `kv_indices[t, :seq_lens[t]]` of the pool (page size 1). The Triton backend runs decode
steps through it (a request's one new token over its row of the req-to-token table); any mode
can be put this way (the torch backend's `query_row_slots`), but many new tokens per request
go through the tiled kernel of extend.py, which reads each key block once per tile of queries.
One program per
(query row, head) streams the keys in blocks with an online softmax, reading K and V of the
head's KV group (GQA) in the pool's dtype and accumulating in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32


@triton.jit
def _attend_block(q, slots, n_ok, d, d_ok, k_head, v_head, stride_ks, stride_vs, state):
    """One block of keys (`slots`, valid where `n_ok`; `k_head`, `v_head`: the pools at this
    program's KV head) into the online softmax state (acc, total, best)."""
    acc, total, best = state
    both = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_head + slots[:, None] * stride_ks + d[None, :], mask=both, other=0.0)
    scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
    scores = tl.where(n_ok, scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=0))
    weights = tl.exp(scores - new_best)
    rescale = tl.exp(best - new_best)
    v = tl.load(v_head + slots[:, None] * stride_vs + d[None, :], mask=both, other=0.0)
    total = total * rescale + tl.sum(weights, axis=0)
    acc = acc * rescale + tl.sum(weights[:, None] * v.to(tl.float32), axis=0)
    return acc, total, new_best


@triton.jit
def _row_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    indices_ptr,
    rows_ptr,
    lens_ptr,
    tail_ptr,
    out_ptr,
    scale,
    stride_it,
    stride_tt,
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
    BLOCK_N: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    k_head = k_ptr + (head // GROUP) * stride_kh
    v_head = v_ptr + (head // GROUP) * stride_vh
    seq_len = tl.load(lens_ptr + row)
    indices_row = tl.load(rows_ptr + row)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0)
    q = q.to(tl.float32) * scale
    best = tl.full([1], float("-inf"), tl.float32)
    state = (tl.zeros([BLOCK_D], tl.float32), tl.zeros([1], tl.float32), best)
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        slots = tl.load(indices_ptr + indices_row * stride_it + n, mask=n < seq_len, other=0)
        state = _attend_block(
            q, slots, n < seq_len, d, d_ok, k_head, v_head, stride_ks, stride_vs, state
        )
    if TAIL > 0:  # the row's own extra slots after its table prefix
        j = tl.arange(0, BLOCK_T)
        slots = tl.load(tail_ptr + row * stride_tt + j, mask=j < TAIL, other=0)
        state = _attend_block(
            q, slots, j < TAIL, d, d_ok, k_head, v_head, stride_ks, stride_vs, state
        )
    acc, total, _ = state
    out = acc / total
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def row_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    rows: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D]; k_pool, v_pool [slots, KVH, D] (H a multiple of KVH); kv_indices [R, L]
    int64 slots, of which query row t uses the first seq_lens[t] (>= 1) of row rows[t] (int64
    [T]; None: row t, with R = T). Returns [T, H, D] in q's dtype: softmax(q k^T * scaling) v
    over each query row's slots. Reads no device value on the host (a CUDA graph may hold
    it): with `rows`, kv_indices may be the req-to-token table itself. `tail` (int64 [T, M]):
    M more slots each query row attends to after its prefix (a draft tree's ancestors)."""
    T, H, _ = q.shape
    if seq_lens.shape != (T,) or (rows is None and kv_indices.shape[0] != T):
        raise ValueError(
            f"seq_lens must be [T] and kv_indices [T, L] without rows, with T = {T} "
            f"(got {tuple(seq_lens.shape)} and {tuple(kv_indices.shape)})"
        )
    if rows is None:
        rows = torch.arange(T, dtype=torch.int64, device=q.device)
    q = q.contiguous()
    if kv_indices.stride(1) != 1:
        kv_indices = kv_indices.contiguous()
    if tail is not None and (tail.dim() != 2 or tail.shape[0] != T):
        raise ValueError(f"tail must be [T, M] with T = {T} (got {tuple(tail.shape)})")
    out = torch.empty_like(q)
    if T == 0:
        return out
    strides, shapes = launch_layout(q, k_pool, v_pool, out)
    width = 0 if tail is None else tail.shape[1]
    tail = rows if tail is None else tail.contiguous()  # any int64 tensor when there is none
    _row_attention_kernel[(T, H)](
        q,
        k_pool,
        v_pool,
        kv_indices,
        rows.contiguous(),
        seq_lens.contiguous(),
        tail,
        out,
        scaling,
        kv_indices.stride(0),
        tail.stride(0),
        *strides,
        **shapes,
        BLOCK_N=BLOCK_N,
        TAIL=width,
        BLOCK_T=max(16, triton.next_power_of_2(max(width, 1))),
    )
    return out


def launch_layout(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor
) -> tuple[tuple[int, ...], dict[str, int]]:
    """What both attention kernels take about their tensors: the token and head strides of q,
    the K and V pools and out, and the head shapes (query heads per KV head, the head dim
    and its power-of-two block). Raises where the query heads do not split into KV groups."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into {kv_heads} KV heads")
    strides = (q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1))
    strides += (v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1))
    shapes = dict(
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return strides, shapes
