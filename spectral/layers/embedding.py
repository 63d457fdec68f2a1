"""A token embedding looked up from GGUF block rows, dequantized per lookup to exactly the
values gguf's own dequantization gives."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import nn


def dequantize(tensor: gguf.ReaderTensor, rows: np.ndarray | None = None) -> torch.Tensor:
    """float32 values of a GGUF tensor (or of its block rows `rows`), by gguf's own code."""
    data = np.asarray(tensor.data if rows is None else rows)
    values = gguf.quants.dequantize(data, tensor.tensor_type)
    return torch.from_numpy(np.require(values, requirements=["C", "W"]))  # float formats: a copy


# Bytes of one 32-weight block of the formats `dequantize_rows` reads.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def dequantize_rows(rows: torch.Tensor, type_name: str) -> torch.Tensor | None:
    """float32 values of block rows (uint8 [n, bytes]) of Q4_0, Q4_1 or Q8_0, by the same
    float32 operations as gguf's own dequantization (so bit-equal to it) but in torch, without
    numpy's per-call cost on every decode step's lookup; None for other formats."""
    if type_name not in BLOCK_BYTES:
        return None
    n = rows.shape[0]
    blocks = rows.view(n, -1, BLOCK_BYTES[type_name])
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    if type_name == "Q8_0":
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).view(n, -1)
    packed = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
    # Low nibbles are the block's first 16 weights, high nibbles the next 16.
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1)
    if type_name == "Q4_0":
        return (d * (q.to(torch.int8) - 8).float()).view(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q.float() + m).view(n, -1)


class BlockEmbedding(nn.Module):
    """A token embedding looked up from its GGUF block rows: only the rows asked for are
    dequantized (in torch for the formats the kernels serve, else by gguf), to exactly the
    values the dequantized table holds, then cast."""

    def __init__(self, tensor: gguf.ReaderTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.tensor = tensor
        self.rows = torch.from_numpy(np.array(tensor.data))  # [vocab, bytes a row], in memory
        self.dtype = dtype
        self.weight = torch.empty(0, dtype=dtype)  # no dense table (as a Linear's from blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1).cpu()
        values = dequantize_rows(self.rows[flat], self.tensor.tensor_type.name)
        if values is None:
            values = dequantize(self.tensor, self.rows[flat].numpy())
        values = values.to(self.dtype)
        return values.view(*input_ids.shape, -1).to(input_ids.device)
