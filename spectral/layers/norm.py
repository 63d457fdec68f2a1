"""RMSNorm, fused with the residual add where spectral's CPU kernels serve it."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


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

        The fused kernel writes x + residual into `residual` in place.
        """
        if self.kernels is not None and x.device.type == "cpu" and x.is_contiguous():
            normed, residual = self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return normed, residual
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), x
