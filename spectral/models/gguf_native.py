"""Serve a GGUF model's own blocks: each Linear of the model (and the LM head) gets the GGUF
tensors it was built from, packed for `gguf_linear`, in place of its dense packed copy.

The dense weights come from the same file (dequantized once into the HF cache directory), so
the blocks must expand to exactly them: the same rows in the same order. The model fuses q|k|v
and gate|up; GGUF stores q and k with their rows permuted for interleaved rotary (llama.cpp's
converter), which is undone here on whole rows of blocks, as transformers does on floats.
Formats the kernels do not implement keep the dense path (a log line says which).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import torch
from torch import nn

from spectral.kernels.linear import Linear, PackedWeight
from spectral.models.config import ModelConfig

logger = logging.getLogger(__name__)

# The block formats gguf_linear expands.
NATIVE_TYPES = ("Q4_1", "Q8_0")

# Our fused Linear (under `layers.{i}.`) and the GGUF tensors of its rows, in order.
LAYER_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows (d, 2) back to (2, d)."""
    half = rows.shape[0] // num_heads // 2
    order = np.arange(rows.shape[0]).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)
    return rows[order]


def attach_gguf_blocks(
    model: nn.Module, config: ModelConfig, path: str | Path, kernels: ModuleType
) -> int:
    """Give every Linear of `model` whose GGUF tensors are all in a native format the packed
    blocks (and the LM head, as `model.lm_head_packed`). Returns how many were attached."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    skipped: set[str] = set()

    def blocks(name: str, num_heads: int | None = None) -> tuple[np.ndarray, str] | None:
        tensor = tensors.get(name)
        if tensor is None:
            return None
        kind = tensor.tensor_type.name
        if kind not in NATIVE_TYPES:
            skipped.add(kind)
            return None
        rows = np.asarray(tensor.data)
        return (unpermute_rows(rows, num_heads) if num_heads else rows), kind

    def packed(parts: list[tuple[np.ndarray, str] | None], k: int) -> PackedWeight | None:
        if any(p is None for p in parts) or len({kind for _, kind in parts}) != 1:
            return None
        rows = np.concatenate([r for r, _ in parts])
        kind = parts[0][1]
        data = kernels.pack_gguf_weight(torch.from_numpy(rows), kind, k)
        return PackedWeight(data, rows.shape[0], kind)

    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    attached = 0
    for i, layer in enumerate(model.layers):
        for ours, theirs in LAYER_LINEARS.items():
            module: Linear = layer.get_submodule(ours)
            parts = [blocks(f"blk.{i}.{t}.weight", heads.get(t)) for t in theirs]
            weight = packed(parts, module.in_features)
            if weight is not None:
                module.packed = weight
                attached += 1
    head_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    head = packed([blocks(head_name)], config.hidden_size)
    if head is not None:
        model.lm_head_packed = head
        if not config.tie_word_embeddings:
            model.lm_head.packed = head
        attached += 1
    if skipped:
        logger.info("GGUF formats %s are served dequantized", ", ".join(sorted(skipped)))
    return attached
