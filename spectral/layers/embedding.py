"""A token embedding looked up from GGUF block rows, dequantized per lookup to exactly the
values gguf's own dequantization gives."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import torch
from torch import nn

from spectral.layers.gguf_blocks import BLOCKS, decode


def dequantize(tensor: gguf.ReaderTensor, rows: np.ndarray | None = None) -> torch.Tensor:
    """float32 values of a GGUF tensor (or of its block rows `rows`), by gguf's own code."""
    data = np.asarray(tensor.data if rows is None else rows)
    values = gguf.quants.dequantize(data, tensor.tensor_type)
    return torch.from_numpy(np.require(values, requirements=["C", "W"]))  # float formats: a copy


class BlockEmbedding(nn.Module):
    """A token embedding looked up from its GGUF block rows: only the rows asked for are
    dequantized (in torch for the formats the kernels serve, else by gguf), to exactly the
    values the dequantized table holds, then cast."""

    def __init__(self, tensor: gguf.ReaderTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.tensor = tensor
        # [vocab, bytes a row], read from the file's mapping as looked up: only the rows in use
        # become resident (a copy held a 152k vocabulary's 130 MB for good). Never written.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            self.rows = torch.from_numpy(tensor.data)
        self.dtype = dtype
        self.weight = torch.empty(0, dtype=dtype)  # no dense table (as a Linear's from blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1).cpu()
        type_name = self.tensor.tensor_type.name
        if type_name in BLOCKS:
            values = decode(self.rows[flat], type_name).dequantize()
        else:
            values = dequantize(self.tensor, self.rows[flat].numpy())
        values = values.to(self.dtype)
        return values.view(*input_ids.shape, -1).to(input_ids.device)
