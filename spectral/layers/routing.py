"""Routing the layers under a module to spectral's CPU kernels (or back to PyTorch)."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from spectral.layers.linear import Linear
from spectral.layers.norm import RMSNorm


def route_to_cpu_kernels(
    root: nn.Module, kernels: ModuleType | None, quantize: str | None = None, int8: bool = False
) -> None:
    """Every `Linear` and `RMSNorm` under `root` uses `kernels` (None: plain PyTorch); the
    Linears pack their weights for them (as GGUF blocks of type `quantize` where given, through
    the integer path with `int8`)."""
    for module in root.modules():
        if isinstance(module, Linear):
            module.set_kernels(kernels, quantize, int8)
        elif isinstance(module, RMSNorm):
            module.kernels = kernels
