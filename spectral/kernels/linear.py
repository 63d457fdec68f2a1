"""Linear layers over spectral's CPU matmul: weights packed once for `packed_linear`, which
serves any number of rows; PyTorch where it cannot (no kernels, another device or dtype)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


def pack_weight(weight: torch.Tensor, kernels: ModuleType | None) -> torch.Tensor | None:
    """`weight` in the layout `kernels.packed_linear` streams, or None where that kernel cannot
    serve it (no kernels, not on the CPU, another dtype). A copy: the caller keeps both."""
    if kernels is None or weight.device.type != "cpu":
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels.pack_linear_weight(weight.detach())


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernels: ModuleType | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias: through `kernels.packed_linear` when `packed` (from `pack_weight`)
    is given and x suits it, else PyTorch."""
    if packed is not None and x.dim() == 2 and x.dtype == weight.dtype:
        return kernels.packed_linear(x, packed, weight.shape[0], bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose `kernels` (None until the worker sets them) serve its matmuls. For
    inference: the packed copy is made when the kernels are set and does not follow later
    changes to the weight."""

    kernels: ModuleType | None = None
    packed: torch.Tensor | None = None

    def set_kernels(self, kernels: ModuleType | None) -> None:
        self.kernels = kernels
        self.packed = pack_weight(self.weight, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels, self.packed)
