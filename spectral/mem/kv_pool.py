"""Token-granular KV storage: per layer, K and V of shape [num_slots + 1, kv_heads, head_dim]."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        shape = (num_slots + 1, num_kv_heads, head_dim)
        # torch.empty leaves untouched pages uncommitted; only the dummy slot must hold zeros
        # (padding reads it, and a NaN there would poison masked-out attention products).
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in self.k + self.v:
            buf[0].zero_()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v[layer].index_copy_(0, loc, v.to(self.dtype))

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V at slots `src` copied to slots `dst`."""
        for buf in self.k + self.v:
            buf[dst] = buf[src]
