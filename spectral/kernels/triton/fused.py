"""The elementwise work of a Llama layer, one launch each: RMSNorm with the residual add,
rotary embedding in place on the fused qkv, and SiLU-and-mul.

Each kernel keeps the roundings of the PyTorch code in spectral.layers (their reference and
the CPU path): values are widened to float32, and a result is rounded to the tensor's dtype
wherever PyTorch rounds it. A product or sum of two bfloat16 (or float16) values taken in
float32 and rounded once is the one PyTorch computes, so half-precision results differ only
where a float32 reduction or exp does. Grids come from shapes alone and nothing is read back
to the host: every launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * stride_residual + cols
        r = tl.load(residual_row, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_row, x, mask=ok)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.math.div_rn(tl.sum(h * h, axis=0), HIDDEN) + eps)
    normed = (h * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(dtype), mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed) of x [T, H] and residual [T, H] (or None), weight [H], all of one
    dtype: summed = x + residual as PyTorch adds them (x itself without a residual), and
    normed = weight * (s * rsqrt(mean(s^2) + eps)).to(dtype) with s = summed.float().

    summed is written into `residual` in place (and returned); normed is a new tensor. One
    program per row."""
    _require_unit_stride(x, "x")
    rows, hidden = x.shape
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be [{hidden}] in {x.dtype} (got {tuple(weight.shape)} {weight.dtype})"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x, {tuple(x.shape)} {x.dtype} "
            f"(got {tuple(residual.shape)} {residual.dtype})"
        )
    if residual is not None:
        _require_unit_stride(residual, "residual")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out, x if residual is None else residual
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(rows,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        eps,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=_warps_for(block),
    )
    return out, x if residual is None else residual


@triton.jit
def _rotation_tables(cos_ptr, sin_ptr, position, stride_cos, stride_sin, d, d_ok, HEAD_DIM, dtype):
    """cos and sin at `position`, each half (columns `d`), rounded to `dtype` as PyTorch's
    path casts the tables, in float32."""
    cos_row = cos_ptr + position * stride_cos + d
    sin_row = sin_ptr + position * stride_sin + d
    cos_first = tl.load(cos_row, mask=d_ok, other=0.0).to(dtype).to(tl.float32)
    cos_second = tl.load(cos_row + HEAD_DIM // 2, mask=d_ok, other=0.0).to(dtype).to(tl.float32)
    sin_first = tl.load(sin_row, mask=d_ok, other=0.0).to(dtype).to(tl.float32)
    sin_second = tl.load(sin_row + HEAD_DIM // 2, mask=d_ok, other=0.0).to(dtype).to(tl.float32)
    return cos_first, cos_second, sin_first, sin_second


@triton.jit
def _rotated(first, ok, tables, HEAD_DIM, dtype):
    """The heads at `first` (their first halves; `ok` masks them) rotated: x * cos +
    rotate_half(x) * sin, each product and the sum rounded to `dtype`."""
    cos_first, cos_second, sin_first, sin_second = tables
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HEAD_DIM // 2, mask=ok, other=0.0).to(tl.float32)
    out1 = (x1 * cos_first).to(dtype).to(tl.float32) + (-x2 * sin_first).to(dtype).to(tl.float32)
    out2 = (x2 * cos_second).to(dtype).to(tl.float32) + (x1 * sin_second).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _rotary_kernel(
    qkv_ptr,
    q_ptr,
    k_pool_ptr,
    v_pool_ptr,
    loc_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE: tl.constexpr,
):
    """Without STORE: the first NUM_HEADS heads of each row rotated in place. With it: the q
    heads rotated into q's own rows, the k heads rotated and the v heads copied into the pools
    at the row's slot."""
    row = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_ok = d < HEAD_DIM // 2
    half = HEAD_DIM // 2
    dtype = qkv_ptr.dtype.element_ty
    tables = _rotation_tables(
        cos_ptr, sin_ptr, position, stride_cos, stride_sin, d, d_ok, HEAD_DIM, dtype
    )
    q_ok = (heads < NUM_HEADS) & d_ok
    q_src = qkv_ptr + row * stride_qkv + heads * HEAD_DIM + d
    out1, out2 = _rotated(q_src, q_ok, tables, HEAD_DIM, dtype)
    q_dst = q_src
    if STORE:
        q_dst = q_ptr + row * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM + d
    tl.store(q_dst, out1, mask=q_ok)
    tl.store(q_dst + half, out2, mask=q_ok)
    if STORE:
        slot = tl.load(loc_ptr + row).to(tl.int64)
        kv_ok = (heads < NUM_KV_HEADS) & d_ok
        k_src = qkv_ptr + row * stride_qkv + (NUM_HEADS + heads) * HEAD_DIM + d
        out1, out2 = _rotated(k_src, kv_ok, tables, HEAD_DIM, dtype)
        k_dst = k_pool_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + d
        tl.store(k_dst, out1.to(k_pool_ptr.dtype.element_ty), mask=kv_ok)
        tl.store(k_dst + half, out2.to(k_pool_ptr.dtype.element_ty), mask=kv_ok)
        v_src = k_src + NUM_KV_HEADS * HEAD_DIM
        v_dst = v_pool_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + d
        for part in tl.static_range(2):
            v = tl.load(v_src + part * half, mask=kv_ok, other=0.0)
            tl.store(v_dst + part * half, v.to(v_pool_ptr.dtype.element_ty), mask=kv_ok)


def rotary_inplace(
    qkv: torch.Tensor,
    num_heads_rotated: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Rotates in place the first `num_heads_rotated` heads (q heads, then k heads) of each
    row of the fused qkv [T, (H + 2 * KVH) * head_dim]: x * cos + rotate_half(x) * sin, with
    the float32 tables cos, sin [max_positions, head_dim] read at row t's positions[t] (int64
    or int32 [T]) and cast to qkv's dtype first. One program per row."""
    _require_unit_stride(qkv, "qkv")
    rows = qkv.shape[0]
    if head_dim % 2 or num_heads_rotated * head_dim > qkv.shape[1]:
        raise ValueError(
            f"cannot rotate {num_heads_rotated} heads of dim {head_dim} (an even number) in "
            f"rows of {qkv.shape[1]}"
        )
    if positions.shape != (rows,) or cos.shape[1] != head_dim or sin.shape != cos.shape:
        raise ValueError(
            f"positions must be [{rows}] and cos, sin [max_positions, {head_dim}] (got "
            f"{tuple(positions.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)})"
        )
    if rows == 0:
        return
    pointers = (qkv, qkv, qkv, qkv, positions)  # no q, pools or slots: rotated in place
    _launch_rotary(qkv, pointers, (cos, sin, positions), head_dim, (num_heads_rotated, 0))


def _launch_rotary(
    qkv: torch.Tensor,
    pointers: tuple,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    head_dim: int,
    heads: tuple[int, int],
) -> None:
    """_rotary_kernel over qkv's rows: `pointers` (qkv, q, the pools and the slots), cos, sin
    and the positions (`tables`); `heads` (q, KV): with KV heads it stores (STORE), without
    them it rotates the q heads in place."""
    cos, sin, positions = tables
    _require_unit_stride(cos, "cos")
    _require_unit_stride(sin, "sin")
    block_h = triton.next_power_of_2(max(heads))
    block_half = triton.next_power_of_2(head_dim // 2)
    _rotary_kernel[(qkv.shape[0],)](
        *pointers,
        cos,
        sin,
        positions,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=heads[0],
        NUM_KV_HEADS=heads[1],
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        STORE=heads[1] > 0,
        num_warps=_warps_for(block_h * block_half),
        enable_fp_fusion=False,  # no fused multiply-add: PyTorch rounds each product
    )


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTERMEDIATE
    dtype = out_ptr.dtype.element_ty
    gate_row = gate_up_ptr + row * stride_in + cols
    gate = tl.load(gate_row, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_row + INTERMEDIATE, mask=ok, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, I] of gate_up [T, 2I] (gate the first half of a row, up the second),
    rounded as `F.silu(gate) * up` is: silu in float32 rounded to the dtype, then the product
    in float32 rounded once (for float32 both roundings are no-ops)."""
    _require_unit_stride(gate_up, "gate_up")
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up rows must hold gate and up halves (got width {width})")
    intermediate = width // 2
    out = gate_up.new_empty((rows, intermediate))
    if rows == 0 or intermediate == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(rows, triton.cdiv(intermediate, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        num_warps=_warps_for(block),
    )
    return out


def rotary_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    """`rotary_inplace`'s rotation in one launch with what follows it in an attention layer:
    returns the rotated q [T, num_heads, head_dim] (new, contiguous), and writes the rotated k
    and the v of row t to the pools [slots, num_kv_heads, head_dim] at slot loc[t]; `qkv`
    itself is left as it was."""
    _require_unit_stride(qkv, "qkv")
    rows = qkv.shape[0]
    pool_shape = (num_kv_heads, head_dim)
    if (num_heads + 2 * num_kv_heads) * head_dim != qkv.shape[1] or head_dim % 2:
        raise ValueError(
            f"qkv rows of {qkv.shape[1]} do not hold {num_heads} + 2 x {num_kv_heads} heads of "
            f"dim {head_dim} (an even number)"
        )
    if tuple(k_pool.shape[1:]) != pool_shape or k_pool.shape != v_pool.shape:
        raise ValueError(f"the pools must be [slots, {num_kv_heads}, {head_dim}] alike")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the pools must be contiguous")
    if loc.shape != (rows,) or positions.shape != (rows,):
        raise ValueError(
            f"loc and positions must be [{rows}] (got {tuple(loc.shape)}, {tuple(positions.shape)})"
        )
    q = torch.empty((rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return q
    pointers = (qkv, q, k_pool, v_pool, loc)
    _launch_rotary(qkv, pointers, (cos, sin, positions), head_dim, (num_heads, num_kv_heads))
    return q


def _warps_for(elements: int) -> int:
    """Warps for a program over `elements` values: 4 up to 1024, then one per 256, at most 16."""
    return min(16, max(4, elements // 256))


def _require_unit_stride(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"{name} must be 2-D with contiguous rows (got shape {tuple(t.shape)}, "
            f"strides {t.stride()})"
        )
