"""Build a model straight from a GGUF file, its blocks served as they are where the kernels can.

Each Linear (and the LM head) whose GGUF tensors are all in formats `gguf_linear` expands in
one layout (spectral.layers.gguf_blocks) gets them packed in place of a dense weight; the token
embedding is looked up from its own blocks; everything else (norms, formats the kernels do not
implement, or every weight with `native` off) is dequantized by gguf's own code into the
model's dtype, the values transformers' GGUF loader produces. The model fuses q|k|v and
gate|up; a Llama GGUF stores q and k with their rows permuted for interleaved rotary
(llama.cpp's converter), which is undone here on whole rows of blocks, as transformers does on
floats.
"""

from __future__ import annotations

import itertools
import logging
import mmap
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import torch
from torch import nn

from spectral.layers.embedding import BlockEmbedding, dequantize
from spectral.layers.gguf_blocks import LAYOUTS, BlockParts, decode, pack_blocks, pack_int8
from spectral.layers.linear import PackedRows, PackedWeight, integer_path
from spectral.layers.parallel import TensorParallel, block_columns, block_shape
from spectral.models.config import ModelConfig
from spectral.models.gguf_reader import WeightsReader
from spectral.models.registry import gguf_architecture
from spectral.models.tensor_parallel import gguf_cuts, llama_shares, shard_llama

logger = logging.getLogger(__name__)

# The block formats gguf_linear expands.
NATIVE_TYPES = tuple(LAYOUTS)
# GGUF architectures whose converter permuted the q and k rows.
PERMUTED_QK = ("llama",)

# Our fused Linear (under `layers.{i}.`) and the GGUF tensors of its rows, in order.
LAYER_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
LAYER_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


# Rows packed at a time: a multiple of every build's panel width (16 or 32 columns).
SLICE_ROWS = 4096


def row_slice(arrays: list[np.ndarray], lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi of `arrays` (stacked in order) as a torch tensor, copying only them."""
    starts = np.cumsum([0] + [a.shape[0] for a in arrays])
    parts = [
        a[max(lo - s, 0) : min(hi - s, a.shape[0])]
        for a, s in zip(arrays, starts)
        if s < hi and s + a.shape[0] > lo
    ]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts)))


def pack_in_slices(
    arrays: list[np.ndarray],
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, str]],
    done: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, str] | None:
    """The rows of `arrays` packed by `pack` a slice of SLICE_ROWS at a time into one tensor,
    holding it and at most two packed slices (whole panels: every slice but the last packs to
    as many bytes); `done(lo, hi)` after each slice's rows are packed. None where the slices
    came out in different layouts."""
    total = sum(a.shape[0] for a in arrays)
    bounds = [(lo, min(lo + SLICE_ROWS, total)) for lo in range(0, total, SLICE_ROWS)]

    def packed(lo: int, hi: int) -> tuple[torch.Tensor, str]:
        out = pack(row_slice(arrays, lo, hi))
        if done is not None:
            done(lo, hi)
        return out

    first, name = packed(*bounds[0])
    if len(bounds) == 1:
        return first, name
    last, last_name = packed(*bounds[-1])
    if last_name != name:
        return None
    size = first.numel()
    out = torch.empty(size * (len(bounds) - 1) + last.numel(), dtype=first.dtype)
    out[:size] = first
    out[size * (len(bounds) - 1) :] = last
    del first, last
    for i, (lo, hi) in enumerate(bounds[1:-1], start=1):
        data, got = packed(lo, hi)
        if got != name:
            return None
        out[i * size : (i + 1) * size] = data
    return out, name


def row_parallel_units(tensors: Iterable[gguf.ReaderTensor]) -> tuple[int, int]:
    """The weights of the largest block among the attention outputs' tensors and among the
    MLP down projections' (the tensors whose input columns tensor parallelism splits)."""
    units = {"attn_output": 1, "ffn_down": 1}
    for t in tensors:
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in units:
            units[kind] = max(units[kind], block_weights(t.tensor_type.name))
    return units["attn_output"], units["ffn_down"]


def block_weights(kind: str) -> int:
    """Weights a block of GGUF format `kind` holds (1 for float formats)."""
    return block_shape(kind)[0]


def bits_per_weight(kind: str) -> float:
    """Bits a weight of GGUF format `kind` takes (scales included)."""
    weights, nbytes = block_shape(kind)
    return 8 * nbytes / weights


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows (d, 2) back to (2, d)."""
    half = rows.shape[0] // num_heads // 2
    order = np.arange(rows.shape[0]).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)
    return rows[order]


class GGUFWeights:
    """The tensors of one GGUF file as a model takes them: rows read (q and k unpermuted, cut to
    a rank's `cuts`), dequantized into parameters or packed for the kernels (`kernels`; `int8`
    and `requantize` as in load_gguf_model), and the file's pages let go once they are."""

    def __init__(
        self,
        reader: WeightsReader,
        path: str | Path,
        kernels: ModuleType | None,
        int8: bool,
        requantize: str | None,
        cuts: dict[str, tuple[slice | None, slice | None]],
        permuted: dict[str, int],
        dtype: torch.dtype,
    ) -> None:
        self.reader, self.path, self.kernels = reader, path, kernels
        self.int8, self.requantize, self.cuts, self.permuted = int8, requantize, cuts, permuted
        self.dtype = dtype
        self.tensors = {t.name: t for t in reader.tensors}
        self.dequantized: set[str] = set()  # the formats filled into dense parameters

    def tensor(self, name: str) -> gguf.ReaderTensor:
        if name not in self.tensors:
            raise ValueError(f"{self.path}: the GGUF has no tensor {name!r}")
        return self.tensors[name]

    def rows_of(self, name: str) -> np.ndarray:
        """The tensor's rows (blocks, or values for float formats), q and k unpermuted, cut to
        `cuts`."""
        parts = name.split(".")
        kind = parts[2] if parts[0] == "blk" else parts[0]
        heads = self.permuted.get(kind) if parts[0] == "blk" else None
        rows = np.asarray(self.tensor(name).data)
        rows = unpermute_rows(rows, heads) if heads else rows
        keep, cols = self.cuts.get(kind, (None, None))
        if keep is not None:
            rows = rows[keep]
        if cols is not None:
            rows = rows[:, block_columns(self.tensor(name).tensor_type.name, cols)]
        return rows

    def stored(self, name: str, requant: bool) -> tuple[np.ndarray, str]:
        """The tensor's rows and their format: as stored, or quantized again to `requantize`
        where `requant` and the stored format has more bits a weight."""
        t = self.tensor(name)
        kind = t.tensor_type.name
        requantize = self.requantize
        if (
            not requant
            or requantize is None
            or bits_per_weight(kind) <= bits_per_weight(requantize)
        ):
            return self.rows_of(name), kind
        values = dequantize(t, self.rows_of(name)).numpy()
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[requantize]), requantize

    def fill(self, param: torch.Tensor, names: list[str]) -> None:
        """Dequantize the tensors `names` into consecutive rows of `param`."""
        offset = 0
        for name in names:
            t = self.tensor(name)
            self.dequantized.add(t.tensor_type.name)
            values = dequantize(t, self.rows_of(name)).reshape(-1, *param.shape[1:])
            param.data[offset : offset + values.shape[0]].copy_(values)
            offset += values.shape[0]

    def blocks(
        self, names: list[str], k: int, index: np.ndarray | None = None, requant: bool = False
    ) -> PackedWeight | PackedRows | None:
        """The tensors `names` packed for gguf_linear as one weight (in parts of one layout
        each where their formats differ), or None where the kernels cannot serve them; with
        `index`, only those rows of the one tensor named; with `requant`, quantized again
        (`stored`)."""
        if index is not None and len(names) != 1:
            raise ValueError("rows are picked from one tensor")
        if self.kernels is None:
            return None
        sources = [self.stored(n, requant) for n in names]
        kinds = [kind for _, kind in sources]
        layouts = [LAYOUTS.get(kind) for kind in kinds]
        if None in layouts:
            return None
        if len(set(layouts)) > 1:
            runs = itertools.groupby(zip(names, layouts), key=lambda pair: pair[1])
            return PackedRows(
                [self.blocks([name for name, _ in run], k, None, requant) for _, run in runs]
            )
        layout = layouts[0]
        if len(set(kinds)) == 1:
            arrays = [rows if index is None else rows[index] for rows, _ in sources]
            return self.pack_one_format(names, arrays, kinds[0], layout, k, whole=index is None)
        parts = [decode(torch.from_numpy(rows), kind) for rows, kind in sources]
        joined = BlockParts.join(parts)
        packed = PackedWeight(joined.pack(self.kernels, layout), joined.quants.shape[0], layout)
        return integer_path(packed, k, self.kernels) if self.int8 else packed

    def pack_one_format(
        self,
        names: list[str],
        arrays: list[np.ndarray],
        kind: str,
        layout: str,
        k: int,
        whole: bool,
    ) -> PackedWeight:
        """The rows `arrays` of the tensors `names`, all of format `kind`, packed a slice of rows
        at a time (panels never straddle one: decoding a whole LM head at once held several
        copies of it at load); `whole` where they are all of their tensors' rows."""
        kernels = self.kernels
        done = None
        if whole and not self.cuts and len(names) == 1 and not names[0].startswith("blk."):
            # an LM head or embedding (150k rows): its file pages let go slice by slice
            done = lambda lo, hi: self.release(names, rows=(lo, hi))  # noqa: E731
        if not self.int8:
            packed = pack_in_slices(
                arrays, lambda rows: (pack_blocks(rows, kind, k, kernels), layout), done
            )
        else:  # float16 scales where every slice keeps them, else float32 in all
            packed = pack_in_slices(
                arrays, lambda rows: pack_int8(rows, kind, k, kernels), done
            ) or pack_in_slices(
                arrays, lambda rows: pack_int8(rows, kind, k, kernels, half=False), done
            )
        data, name = packed
        return PackedWeight(data, sum(a.shape[0] for a in arrays), name)

    def linear(self, module: nn.Module, names: list[str], requant: bool = False) -> bool:
        """Serve `module` from its blocks (its dense weight emptied) or fill it; True if blocks."""
        packed = self.blocks(names, module.in_features, None, requant)
        if packed is not None:
            module.packed = packed
            module.weight = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
        else:
            self.fill(module.weight, names)
        if module.bias is not None:
            self.fill(module.bias, [n.replace(".weight", ".bias") for n in names])
        self.release(names)
        return packed is not None

    def release(self, names: list[str], rows: tuple[int, int] | None = None) -> None:
        """Drop from memory the file pages `names` (or their `rows` lo..hi) were read from,
        packed or copied by now (a later read maps them again): the file is not held resident
        beside its packing."""
        mapped = getattr(self.reader.data, "_mmap", None)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        for name in names:
            t = self.tensor(name)
            begin, end = t.data_offset, t.data_offset + t.n_bytes
            if rows is not None:
                row_bytes = t.n_bytes // t.data.shape[0]
                begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
            start = begin // mmap.PAGESIZE * mmap.PAGESIZE
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def load_gguf_model(
    path: str | Path,
    model: nn.Module,
    config: ModelConfig,
    kernels: ModuleType | None,
    int8: bool = False,
    requantize: str | None = None,
    tp: TensorParallel | None = None,
) -> int:
    """Fill `model` (built empty, in its dtype, on the CPU) from the GGUF file at `path`. With
    `kernels`, weights in NATIVE_TYPES stay blocks (their dense parameters are emptied) and a
    block-format token embedding is looked up in place; without, everything is dequantized.
    With `int8`, the block weights go through the integer path (layers.linear.integer_path).
    With `requantize` (a block format gguf can quantize to, e.g. "Q4_1"), the layers' matmul
    weights stored in more bits a weight are quantized again to it by gguf's own code (a draft
    model's memory traffic; the LM head and the embedding stay as stored). With `tp`, the
    model (built whole) is cut to the rank's shares (models.tensor_parallel, o's and down's
    input columns in whole blocks of their formats) and each tensor kind's rows and input
    columns in them are all that is read, packed and held; the embedding, where looked up from
    its blocks, stays whole (lookups read only their rows).
    Returns how many weight matrices are served as blocks."""
    reader = WeightsReader(str(path))
    cuts: dict[str, tuple[slice | None, slice | None]] = {}
    if tp is not None:
        shares = llama_shares(config, tp, *row_parallel_units(reader.tensors))
        shard_llama(model, shares, cut=False)
        cuts = gguf_cuts(shares)
    arch = gguf_architecture(reader, path)
    permuted = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    if arch not in PERMUTED_QK:
        permuted = {}
    dtype = next(model.parameters()).dtype
    weights = GGUFWeights(reader, path, kernels, int8, requantize, cuts, permuted, dtype)
    native = load_layers(model, weights)
    native += load_lm_head(model, config, weights)
    load_embedding(model, config, weights)
    if kernels is not None and weights.dequantized - {"F32", "F16", "BF16"}:
        logger.info(
            "GGUF formats %s are served dequantized (native: %s)",
            ", ".join(sorted(weights.dequantized - {"F32", "F16", "BF16"})),
            ", ".join(NATIVE_TYPES),
        )
    return native


def load_layers(model: nn.Module, weights: GGUFWeights) -> int:
    """The decoder layers' Linears (quantized again where asked) and norms, and the final norm;
    returns how many Linears are served as blocks."""
    native = 0
    for i, layer in enumerate(model.layers):
        for ours, theirs in LAYER_LINEARS.items():
            names = [f"blk.{i}.{t}.weight" for t in theirs]
            native += weights.linear(layer.get_submodule(ours), names, requant=True)
        for ours, theirs in LAYER_NORMS.items():
            weights.fill(layer.get_submodule(ours).weight, [f"blk.{i}.{theirs}.weight"])
    weights.fill(model.norm.weight, ["output_norm.weight"])
    return native


def load_lm_head(model: nn.Module, config: ModelConfig, weights: GGUFWeights) -> int:
    """The LM head (the token embedding's blocks where tied), served from blocks where the
    kernels can, and packed again by rows for a draft's hot vocabulary; 1 if from blocks."""
    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    if config.tie_word_embeddings:
        model.lm_head_packed = weights.blocks([head], config.hidden_size)
        native = model.lm_head_packed is not None
        weights.release([head])
    else:
        native = weights.linear(model.lm_head, [head])
        model.lm_head_packed = model.lm_head.packed
    if model.lm_head_packed is not None:
        # a draft's hot vocabulary packs its rows of the head again (LogitsHead.restricted)
        model.logits_head.pack_rows = lambda ids: weights.blocks([head], config.hidden_size, ids)
    return int(native)


def load_embedding(model: nn.Module, config: ModelConfig, weights: GGUFWeights) -> None:
    """The token embedding, looked up from its blocks with the kernels, unless a tied LM head
    not served from blocks needs its dense table."""
    if weights.kernels is not None and (
        model.lm_head_packed is not None or not config.tie_word_embeddings
    ):
        model.embed_tokens = BlockEmbedding(weights.tensor("token_embd.weight"), weights.dtype)
        model.vocab_start = None  # whole on every rank: no vocabulary-parallel lookup
    else:
        weights.fill(model.embed_tokens.weight, ["token_embd.weight"])
