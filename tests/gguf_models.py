"""Tiny random models written as GGUF files with gguf-py's writer, the way llama.cpp's converter
lays them out: its metadata keys, its tensor names, norms and biases in F32, every matrix in one
format, and a small real byte-level BPE vocabulary (the default model's first tokens and the
merges that make them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from spectral.models.resolve import default_model_file

VOCAB_SIZE = 512


@dataclass(frozen=True)
class TinyArch:
    """One architecture's features, as its GGUF states them."""

    gguf_arch: str  # general.architecture
    name: str  # general.name
    tokenizer_pre: str
    qkv_bias: bool
    tied: bool
    rope_theta: float


ARCHS = {
    "llama": TinyArch("llama", "tiny llama", "smollm", False, True, 10000.0),
    "mistral": TinyArch("llama", "Tiny Mistral Instruct", "smollm", False, False, 1e6),
    "qwen2": TinyArch("qwen2", "tiny qwen2", "qwen2", True, False, 1e6),
}
# Float formats and the block formats spectral serves natively.
FORMATS = ("F32", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# The K-quants, which gguf's Python package cannot quantize (quantize_k does), and file types.
K_FORMATS = {
    "Q4_K": "MOSTLY_Q4_K_S",
    "Q5_K": "MOSTLY_Q5_K_S",
    "Q6_K": "MOSTLY_Q6_K",
    "Q4_K_M": "MOSTLY_Q4_K_M",  # llama.cpp's mix: Q6_K attn_v, ffn_down and output, else Q4_K
}
Q4_K_M_SIX = ("attn_v", "ffn_down", "output.weight")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 256, 512, 2, 4, 2, 2048


@functools.cache
def small_vocab(size: int = VOCAB_SIZE) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the default model's first `size` tokens (its control
    tokens, the 256 bytes, then the first merges in order) and the merges among them."""
    reader = gguf.GGUFReader(str(default_model_file()))
    tokens_field = reader.fields["tokenizer.ggml.tokens"]
    types_field = reader.fields["tokenizer.ggml.token_type"]
    merges_field = reader.fields["tokenizer.ggml.merges"]
    tokens = [tokens_field.contents(i) for i in range(size)]
    types = [int(types_field.contents(i)) for i in range(size)]
    known = set(tokens)
    merges = []
    for i in range(len(merges_field.data)):
        left, right = merges_field.contents(i).split(" ")
        if left + right not in known:
            break  # merges come in vocabulary order: the rest make tokens beyond `size`
        merges.append(f"{left} {right}")
    return tokens, types, merges


def write_tiny_gguf(
    path: Path, arch: str, fmt: str, seed: int = 0, architecture_last: bool = False
) -> Path:
    """A 2-layer random model of architecture `arch` with every matrix in format `fmt`."""
    spec = ARCHS[arch]
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    writer = gguf.GGUFWriter(str(path), spec.gguf_arch)
    writer.add_name(spec.name)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(VOCAB_SIZE)
    file_type = "ALL_F32" if fmt == "F32" else K_FORMATS.get(fmt, f"MOSTLY_{fmt}")
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    tokens, types, merges = small_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)

    def matrix(name: str, rows: int, cols: int, scale: float) -> None:
        values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        kind = fmt
        if fmt == "Q4_K_M":
            kind = "Q6_K" if any(part in name for part in Q4_K_M_SIX) else "Q4_K"
        qtype = gguf.GGMLQuantizationType[kind] if kind != "F32" else None
        if fmt == "F32":
            writer.add_tensor(name, values)
        elif kind in K_FORMATS:
            writer.add_tensor(name, quantize_k(values, kind), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    def vector(name: str, size: int, mean: float, scale: float) -> None:
        writer.add_tensor(name, (mean + rng.standard_normal(size) * scale).astype(np.float32))

    matrix("token_embd.weight", VOCAB_SIZE, HIDDEN, 0.1)
    q_size, kv_size = HEADS * head_dim, KV_HEADS * head_dim
    for i in range(LAYERS):
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0, 0.2)
        for part, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            matrix(f"blk.{i}.attn_{part}.weight", rows, HIDDEN, HIDDEN**-0.5)
            if spec.qkv_bias:  # large enough that dropping them changes every output
                vector(f"blk.{i}.attn_{part}.bias", rows, 0.0, 1.0)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, q_size, q_size**-0.5)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0, 0.2)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, HIDDEN**-0.5)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, HIDDEN**-0.5)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, FFN**-0.5)
    vector("output_norm.weight", HIDDEN, 1.0, 0.2)
    if not spec.tied:
        matrix("output.weight", VOCAB_SIZE, HIDDEN, 0.2)

    return finish(writer, path, architecture_last)


def quantize_k(values: np.ndarray, fmt: str) -> np.ndarray:
    """`values` [rows, k] (k a multiple of 256) as Q4_K or Q5_K blocks (uint8 [rows, bytes]):
    per 32 weights a 6-bit scale and minimum of the superblock's fp16 d and dmin, then 4- or
    5-bit quants (a plain round-to-nearest quantizer; the tests compare readers of one file)."""
    rows, k = values.shape
    if fmt == "Q6_K":
        return quantize_q6_k(values)
    levels = 15 if fmt == "Q4_K" else 31
    x = values.reshape(rows, k // 256, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0.0)
    step = np.maximum((x.max(-1) - low) / levels, 1e-8)
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (-low).max(-1) / 63
    dmin = np.where(dmin > 0, dmin, 1e-8).astype(np.float16)
    sc = np.clip(np.rint(step / d.astype(np.float32)[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    q = np.clip(np.rint((x + offset[..., None]) / scale[..., None]), 0, levels).astype(np.uint8)
    packed = np.zeros((rows, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    pairs = q.reshape(rows, k // 256, 4, 2, 32)  # sub-blocks 2i and 2i + 1 share 32 bytes
    nibbles = ((pairs[..., 0, :] & 15) | ((pairs[..., 1, :] & 15) << 4)).reshape(rows, -1, 128)
    parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed]
    if fmt == "Q5_K":  # byte j of the 32 holds the fifth bit of weight j of every sub-block
        fifth = (q >> 4).transpose(0, 1, 3, 2)  # [rows, superblocks, 32, 8 sub-blocks]
        parts.append(np.packbits(fifth, axis=-1, bitorder="little")[..., 0])
    parts.append(nibbles)
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """`values` [rows, k] as Q6_K blocks: per 16 weights an int8 scale of the superblock's fp16
    d (stored last), 6-bit quants q - 32 split into 4 low bits and 2 high bits."""
    rows, k = values.shape
    x = values.reshape(rows, k // 256, 16, 16).astype(np.float32)
    step = np.maximum(np.abs(x).max(-1) / 31, 1e-8)
    d = (step.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(step / d.astype(np.float32)[..., None]), 1, 127).astype(np.int8)
    scale = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.rint(x / scale[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, k // 256, 2, 4, 32)  # halves of 128: four runs of 32
    low = q & 15
    ql = (low[..., 0:2, :] | (low[..., 2:4, :] << 4)).reshape(rows, -1, 128)
    hi = q >> 4
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    parts = [ql, qh.reshape(rows, -1, 64), sc.view(np.uint8), d[..., None].view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def write_foreign_gguf(path: Path, arch: str, architecture_last: bool = False) -> Path:
    """A GGUF of an architecture spectral does not implement (a header and one tensor)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    return finish(writer, path, architecture_last)


def finish(writer: gguf.GGUFWriter, path: Path, architecture_last: bool = False) -> Path:
    """Write the file; with `architecture_last`, general.architecture after every other key
    (llama.cpp's writer puts it first)."""
    if architecture_last:
        keys = writer.kv_data[0]
        keys["general.architecture"] = keys.pop("general.architecture")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
