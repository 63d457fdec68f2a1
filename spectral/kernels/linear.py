"""Linear layers that route decode-sized inputs to the small-M CPU kernel."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from spectral.kernels.cpu_kernels import small_m_linear_supported


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernels: ModuleType | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias; through `kernels.small_m_linear` when given and the shapes suit it."""
    if kernels is not None and small_m_linear_supported(x, weight):
        return kernels.small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose `kernels` (None until the worker sets it) may serve small inputs."""

    kernels: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)
