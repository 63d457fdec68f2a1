"""The attention backends by name, and the one `auto` picks for a device and dtype."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from spectral.attention.base import AttentionBackend
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool


def create_attention_backend(
    name: str,
    kv_pool: KVPool,
    req_to_token: ReqToTokenPool,
    scaling: float,
    device: str,
    kernels: ModuleType | None = None,
    num_heads: int | None = None,
) -> AttentionBackend:
    """`auto` picks by device (`default_attention_backend`). `kernels` (spectral's CPU
    kernels) serve the torch backend's decode and tree steps; `num_heads` (query heads) lets
    flashinfer plan static decode batches ahead of their first layer."""
    if name == "auto":
        name = default_attention_backend(device, kv_pool.dtype)
    if name == "torch":
        from spectral.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, req_to_token, scaling, kernels)
    if name == "triton":
        from spectral.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_pool, req_to_token, scaling)
    if name == "flashinfer":
        from spectral.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(kv_pool, req_to_token, scaling, num_heads)
    raise ValueError(
        f"unknown attention backend {name!r}; available: auto, torch, triton, flashinfer"
    )


def default_attention_backend(device: str, dtype: torch.dtype) -> str:
    """CPU: torch (with the CPU kernels). CUDA: flashinfer where it is installed and the KV
    cache is float16 or bfloat16 (its kernels' types), else triton."""
    if not device.startswith("cuda"):
        return "torch"
    if dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flashinfer"):
        return "flashinfer"
    return "triton"
