"""RMSNorm, fused with the residual add where spectral's CPU kernels or, on CUDA, a fused
kernel (layers.cuda_fused) serve it."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from spectral.layers import cuda_fused


class RMSNorm(nn.Module):
    kernels: ModuleType | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); without a residual, (norm(x), x).

        The fused kernels write x + residual into `residual` in place; on CUDA, FlashInfer's
        also writes the normed result over x.
        """
        if self.kernels is not None and x.device.type == "cpu" and x.is_contiguous():
            normed, residual = self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return normed, residual
        if x.is_cuda:
            fused = cuda_fused.add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), x
