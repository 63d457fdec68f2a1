"""Which fused kernel serves a CUDA tensor of the Llama layers: FlashInfer's for bfloat16 and
float16 where it imports, else spectral's Triton kernels (kernels.triton.fused) where triton
imports. Each function returns None (or False) where neither serves, and the layer runs its
PyTorch code; CPU tensors always get that answer (they go to spectral's C++ kernels or the
PyTorch reference). Neither library is imported before a CUDA tensor asks for it."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def flashinfer_module() -> ModuleType | None:
    """The flashinfer package with its norm, rope and activation modules, or None."""
    try:
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope
    except (ImportError, OSError, RuntimeError):
        return None
    return flashinfer


@functools.cache
def triton_module() -> ModuleType | None:
    """spectral's fused Triton kernels, or None where triton does not import."""
    try:
        from spectral.kernels.triton import fused
    except ImportError:
        return None
    return fused


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(normed, summed) as RMSNorm.forward gives them, or None where no fused kernel serves
    (not CUDA, not contiguous, mixed dtypes). Both kernels write summed into `residual` in
    place; FlashInfer's also writes normed over x (and returns x)."""
    if not x.is_cuda or not x.is_contiguous() or x.numel() == 0 or weight.dtype != x.dtype:
        return None
    if residual is not None and (
        residual.dtype != x.dtype or residual.shape != x.shape or not residual.is_contiguous()
    ):
        return None
    rows = x.view(-1, x.shape[-1])
    fi = flashinfer_module() if x.dtype in FLASHINFER_DTYPES else None
    if fi is not None:
        if residual is None:
            return fi.norm.rmsnorm(rows, weight, eps).view_as(x), x
        fi.norm.fused_add_rmsnorm(rows, residual.view_as(rows), weight, eps)
        return x, residual
    kernels = triton_module()
    if kernels is None:
        return None
    normed, _ = kernels.add_rms_norm(
        rows, None if residual is None else residual.view_as(rows), weight, eps
    )
    return normed.view_as(x), x if residual is None else residual


def rotate_qkv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> bool:
    """Rotates the q and k heads of the fused qkv [T, (H + 2 * KVH) * D] in place at
    `positions` [T]; False where no fused kernel serves (then nothing was done). FlashInfer
    reads `cos_sin_cache`, float32 [max_positions, D], each row its cos half then its sin half
    (the same rotation where the tables repeat their half, as RotaryEmbedding's do); Triton
    reads cos and sin."""
    if not _fusable_qkv(qkv, positions):
        return False
    fi = None
    if qkv.dtype in FLASHINFER_DTYPES and cos_sin_cache.dtype == torch.float32:
        fi = flashinfer_module()
    if fi is not None:
        q_size, k_size = num_heads * head_dim, num_kv_heads * head_dim
        fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions,
            qkv[:, :q_size],
            qkv[:, q_size : q_size + k_size],
            head_dim,
            cos_sin_cache,
            is_neox=True,
        )
        return True
    kernels = triton_module()
    if kernels is None:
        return False
    kernels.rotary_inplace(qkv, num_heads + num_kv_heads, head_dim, cos, sin, positions)
    return True


def rotate_and_store(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    positions: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor | None:
    """The rotated q [T, H, D] of the fused qkv (`heads`: H, KVH, D; `tables`: cos, sin), its
    k rotated and its v written to the pools `kv` = (k_pool, v_pool, slots) in one launch
    (Triton's `rotary_store`: rotation, two KV writes and q's copy to contiguous rows in one),
    or None where it does not serve (nothing done)."""
    k_pool, v_pool, loc = kv
    num_heads, num_kv_heads, head_dim = heads
    if not _fusable_qkv(qkv, positions) or k_pool.dtype != qkv.dtype or not loc.is_contiguous():
        return None
    if (num_heads + 2 * num_kv_heads) * head_dim != qkv.shape[1]:
        return None
    kernels = triton_module()
    if kernels is None:
        return None
    return kernels.rotary_store(qkv, *heads, *tables, positions, k_pool, v_pool, loc)


def _fusable_qkv(qkv: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether a fused rotary kernel can take this qkv: 2-D rows on a GPU, both contiguous."""
    if not qkv.is_cuda or not qkv.is_contiguous() or qkv.dim() != 2 or qkv.shape[0] == 0:
        return False
    return positions.is_contiguous()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up [..., I] of gate_up [..., 2I], or None where no fused kernel serves."""
    if not gate_up.is_cuda or not gate_up.is_contiguous() or gate_up.numel() == 0:
        return None
    fi = flashinfer_module() if gate_up.dtype in FLASHINFER_DTYPES else None
    if fi is not None:
        return fi.activation.silu_and_mul(gate_up)
    kernels = triton_module()
    if kernels is None:
        return None
    out = kernels.silu_and_mul(gate_up.view(-1, gate_up.shape[-1]))
    return out.view(*gate_up.shape[:-1], out.shape[-1])
