"""Linear layers over spectral's CPU matmuls: weights packed once, dense (`packed_linear`) or
as GGUF blocks (`gguf_linear`); either serves any number of rows. PyTorch where neither can
(no kernels, another device or dtype)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PackedWeight:
    """A weight [n, k] in the layout one of the CPU kernels streams: dense (float32 or
    bfloat16, `gguf_type` None) or GGUF blocks in the `gguf_linear` layout `gguf_type` (Q4_1,
    Q8_0, Q8_0m, Q8_0h: spectral.layers.gguf_blocks), expanded in registers to exactly the
    values the dequantized weight holds in the model's dtype."""

    data: torch.Tensor
    n: int
    gguf_type: str | None = None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def matmul(self, kernels: ModuleType, x: torch.Tensor, bias: torch.Tensor | None):
        if self.gguf_type is not None:
            return kernels.gguf_linear(x, self.data, self.gguf_type, self.n, bias)
        return kernels.packed_linear(x, self.data, self.n, bias)

    def serves(self, x: torch.Tensor) -> bool:
        if x.dim() != 2 or x.device.type != "cpu":
            return False
        if self.gguf_type is not None:
            return x.dtype in (torch.float32, torch.bfloat16)
        return x.dtype == self.data.dtype


@dataclass
class PackedRows:
    """A weight served from packed parts stacked by rows: a fused weight (q|k|v) whose GGUF
    tensors come in formats of different layouts (a Q4_K_M file's Q4_K q and k, Q6_K v)."""

    parts: list[PackedWeight]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @classmethod
    def of(cls, packed: PackedWeight | PackedRows) -> PackedRows:
        return packed if isinstance(packed, PackedRows) else cls([packed])

    def matmul(self, kernels: ModuleType, x: torch.Tensor, bias: torch.Tensor | None):
        return kernels.linear_parts(x, *self.fields(), bias)

    def fields(self) -> tuple[list[torch.Tensor], list[str], list[int]]:
        """The parts' data, layouts ("" for dense) and row counts, as the kernels take them."""
        parts = self.parts
        return [p.data for p in parts], [p.gguf_type or "" for p in parts], [p.n for p in parts]

    def serves(self, x: torch.Tensor) -> bool:
        return all(part.serves(x) for part in self.parts)


def pack_weight(weight: torch.Tensor, kernels: ModuleType | None) -> PackedWeight | None:
    """`weight` packed for `kernels.packed_linear`, or None where that kernel cannot serve it
    (no kernels, not on the CPU, another dtype). A copy: the caller keeps both."""
    if kernels is None or weight.device.type != "cpu":
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return PackedWeight(kernels.pack_linear_weight(weight.detach()), weight.shape[0])


def quantize_weight(
    weight: torch.Tensor, kernels: ModuleType | None, gguf_type: str = "Q8_0"
) -> PackedWeight | None:
    """`weight` quantized to GGUF blocks of `gguf_type` by gguf's own quantizer and packed for
    `kernels.gguf_linear`, or None where that kernel cannot serve it (no kernels, not on the
    CPU, rows not a whole number of 32-weight blocks)."""
    if kernels is None or weight.device.type != "cpu" or weight.shape[1] % 32:
        return None
    from gguf import GGMLQuantizationType, quants

    blocks = quants.quantize(weight.detach().float().numpy(), GGMLQuantizationType[gguf_type])
    data = kernels.pack_gguf_weight(torch.from_numpy(blocks), gguf_type, weight.shape[1])
    return PackedWeight(data, weight.shape[0], gguf_type)


def integer_path(packed: PackedWeight, k: int, kernels: ModuleType) -> PackedWeight:
    """GGUF blocks (`packed`, k inputs) regrouped for the integer path: `gguf_linear` then
    quantizes each input row to 8 bits per 32 and sums the blocks in integer dot products
    (layout "<layout>+q8", with "f16" after the layout where its scales are all float16
    values; spectral/kernels/cpu/quant_int8_tiles.cpp)."""
    data, layout = kernels.pack_q8_layout(packed.data, packed.gguf_type, packed.n, k, True)
    return PackedWeight(data, packed.n, layout + "+q8")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernels: ModuleType | None = None,
    packed: PackedWeight | PackedRows | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias: through the CPU kernels when `packed` is given and x suits it,
    else PyTorch."""
    if packed is not None and packed.serves(x):
        return packed.matmul(kernels, x, bias)
    if weight.numel() == 0:  # kept only as GGUF blocks (spectral.models.gguf_native)
        raise ValueError(
            f"this weight is kept only as GGUF blocks, which serve 2-D float32 or bfloat16 "
            f"inputs on the CPU (got {x.dtype}, {x.dim()}-D, on {x.device}); load the model "
            "with --quantization none to serve others"
        )
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose `kernels` (None until the worker sets them) serve its matmuls. For
    inference: the packed copy is made when the kernels are set (or GGUF blocks are attached)
    and does not follow later changes to the weight."""

    kernels: ModuleType | None = None
    packed: PackedWeight | PackedRows | None = None

    def set_kernels(
        self, kernels: ModuleType | None, quantize: str | None = None, int8: bool = False
    ) -> None:
        """Serve matmuls through `kernels`, packing the weight for them (quantized to GGUF
        blocks of type `quantize` where given and possible, through the integer path with
        `int8`) unless a packed form (GGUF blocks) is attached already."""
        self.kernels = kernels
        if kernels is None or self.packed is None:
            packed = quantize_weight(self.weight, kernels, quantize) if quantize else None
            if packed is not None and int8:
                packed = integer_path(packed, self.in_features, kernels)
            self.packed = packed or pack_weight(self.weight, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels, self.packed)


def weight_tensors(root: nn.Module, buffers: bool = False) -> Iterator[torch.Tensor]:
    """The weights `root` holds, in its modules' order: its parameters and the packed weights
    its modules (and their heads) keep; with `buffers`, its buffers too (rotary tables)."""
    for module in root.modules():
        yield from module.parameters(recurse=False)
        if buffers:
            yield from module.buffers(recurse=False)
        for value in vars(module).values():
            for packed in (value, getattr(value, "packed", None)):  # a head's own packed copy
                if isinstance(packed, (PackedWeight, PackedRows)):
                    yield from (part.data for part in PackedRows.of(packed).parts)


def weight_bytes(root: nn.Module) -> int:
    """Bytes of the weights `root` holds (`weight_tensors`), a tied weight counted once (by
    its own bytes: its storage may be a slab it shares, spectral/mem/weights.py)."""
    return sum({t.data_ptr(): t.nbytes for t in weight_tensors(root) if t.numel()}.values())
