"""Rotary position embeddings: the config's rope (default, or transformers' scaled types) as
cos/sin tables, applied in place by spectral's CPU kernels or, on CUDA, a fused kernel
(layers.cuda_fused) where they serve it."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from spectral.layers import cuda_fused


def rope_settings(hf: PretrainedConfig) -> tuple[str, float]:
    """(rope type, rope theta) of a HF config."""
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    return rope_type, float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def rope_inverse_frequencies(hf: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling) per the config's rope settings."""
    rope_type, theta = rope_settings(hf)
    if rope_type == "default":
        dim = head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
        inv_freq = 1.0 / (theta**exponents)
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise NotImplementedError(
            "dynamic NTK rope scaling changes with the sequence length and is not supported; "
            "supported rope types: default, "
            + ", ".join(sorted(set(ROPE_INIT_FUNCTIONS) - {"dynamic"}))
        )
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"unknown rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (float32) for every position up to the context length, each row its
    half repeated; `cos_sin_cache` holds the halves side by side (FlashInfer's layout). Made on
    the CPU even under a meta device context (`.to(device)` moves them): filling tensors on
    meta costs seconds the first time (torch imports its decompositions)."""

    def __init__(self, hf_config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inverse_frequencies(hf_config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        half = inv_freq.shape[0]
        cos_sin = torch.cat((self.cos[:, :half], self.sin[:, :half]), dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def rotate_qkv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        kernels: ModuleType | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q [T, H, D] and k [T, KVH, D]; q and k are views into the fused `qkv`, which
        the kernel rotates in place."""
        if kernels is not None and qkv.device.type == "cpu" and qkv.stride(1) == 1:
            num_heads = q.shape[1] + k.shape[1]
            kernels.rotary_inplace(qkv, num_heads, q.shape[2], self.cos, self.sin, positions)
            return q, k
        heads = (q.shape[1], k.shape[1], q.shape[2])
        tables = (self.cos, self.sin, self.cos_sin_cache)
        if qkv.is_cuda and cuda_fused.rotate_qkv(qkv, *heads, positions, *tables):
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor | None:
        """The rotated q [T, H, D] of the fused qkv (`heads`: H, KVH, D), its rotated k and its
        v stored in the pools `kv` (k_pool, v_pool, slots) by one fused kernel on a GPU; None
        where none serves (nothing done: `rotate_qkv`, then the backend stores)."""
        return cuda_fused.rotate_and_store(qkv, heads, positions, (self.cos, self.sin), kv)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
