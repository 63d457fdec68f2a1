"""Token-granular KV storage: per layer, K and V of shape [num_slots + 1, kv_heads, head_dim].

On a CPU the pool is written whole when it is made, so that its memory is the process's from the
start (`check_fits` first refuses a pool the memory left cannot hold): a pool committed lazily
grows the process under load, by the pages requests first write, until the system kills it for
memory long after start-up; and it hides a leak behind that growth."""

from __future__ import annotations

import torch

GIB = 2**30


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
        commit: bool = True,
    ) -> None:
        """`commit`: on a CPU, write every page now (else only the dummy slot, which must hold
        zeros: padding reads it, and a NaN there would poison masked-out attention products;
        on a GPU the allocator's memory is committed anyway)."""
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.dtype = dtype
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        whole = commit and torch.device(device).type == "cpu"
        for buf in self.k + self.v:
            (buf if whole else buf[0]).zero_()
        self.committed = whole

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.k + self.v)

    @staticmethod
    def check_fits(num_slots: int, bytes_per_token: int, available: int, where: str) -> None:
        """RuntimeError naming the sizes where a pool of `num_slots` tokens needs more than the
        `available` bytes (`where` says whose)."""
        need = num_slots * bytes_per_token
        if need > available:
            raise RuntimeError(
                f"the KV pool of {num_slots} tokens needs {need / GIB:.2f} GiB "
                f"({bytes_per_token} bytes a token) but {available / GIB:.2f} GiB {where}; "
                "lower --max-total-tokens or --mem-fraction-static, or free memory"
            )

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
