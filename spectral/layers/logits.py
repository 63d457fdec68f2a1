"""The LM head as a layer: float32 logits over the vocabulary from final hidden states, through
the CPU kernels' packed copy of the head (dense or GGUF blocks) where they serve it."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from spectral.layers.linear import PackedWeight, linear, pack_weight


class LogitsHead:
    """Logits [R, vocab] = hidden [R, H] @ weight.T, in float32.

    It owns no parameter: the weight stays with the module the checkpoint names (an `lm_head`,
    or the token embedding where tied), so state dicts keep the checkpoints' names. `weight` is
    the tensor, or a function that gives it at call time (for an owner that replaces it)."""

    def __init__(self, weight: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        self._weight = weight
        self.kernels: ModuleType | None = None
        self.packed: PackedWeight | None = None
        # Where the head is kept only as GGUF blocks: rows (token ids) -> those rows packed.
        self.pack_rows: Callable[[np.ndarray], PackedWeight | None] | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [vocab, H] (empty where only GGUF blocks of it are kept)."""
        return self._weight() if callable(self._weight) else self._weight

    def set_kernels(self, kernels: ModuleType | None, packed: PackedWeight | None = None) -> None:
        """Serve the matmul through `kernels` (None: PyTorch), from a packed form attached
        before (GGUF blocks) if any, else `packed` (the owner's copy), else a copy packed now."""
        self.kernels = kernels
        if kernels is None or self.packed is None:
            self.packed = packed if packed is not None else pack_weight(self.weight, kernels)

    def restricted(self, ids: torch.Tensor) -> LogitsHead:
        """A head over the rows `ids` of this one (logits [R, len(ids)], each column equal to
        this head's column of that id), served as this one is: for a draft's hot vocabulary."""
        weight = self.weight
        if weight.numel() == 0 and self.pack_rows is None:
            raise ValueError("this LM head keeps no rows to restrict")
        head = LogitsHead(weight[ids].clone() if weight.numel() else weight)
        packed = None
        if self.pack_rows is not None and self.kernels is not None:
            packed = self.pack_rows(ids.cpu().numpy())
        head.set_kernels(self.kernels, packed)
        return head

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, None, self.kernels, self.packed).float()
