"""GGUF block formats decoded in torch into `BlockParts`: a float32 scale d (and minimum m) per
32 weights (per 16 for Q6_K) and a quant q per weight, with w = d * q + m exactly gguf's own
dequantization (d * q is exact in float32, or rounded once as gguf does for Q6_K; one rounding
adds m, as gguf's does). The parts are what `gguf_linear` streams (packed in one of its
layouts) and what an embedding's rows dequantize from."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

# (weights, bytes) of one block of each format decoded here.
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
# The gguf_linear layout each format is served in: 4-bit quants with m (Q4_1), 8-bit quants
# (Q8_0), 8-bit quants with m (Q8_0m), 8-bit quants with a d per 16 (Q8_0h). Q4_0, Q4_1 and
# Q8_0 are packed as they are stored.
LAYOUTS = {
    "Q4_0": "Q4_1",
    "Q4_1": "Q4_1",
    "Q8_0": "Q8_0",
    "Q5_0": "Q8_0",
    "Q5_1": "Q8_0m",
    "Q4_K": "Q4_1",
    "Q5_K": "Q8_0m",
    "Q6_K": "Q8_0h",
}
STORED_LAYOUT = ("Q4_0", "Q4_1", "Q8_0")
# Formats whose layout's scales are the file's float16 values (Q4_0's minimum, -8 d, too).
HALF_SCALES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1")


@dataclass
class BlockParts:
    scales: torch.Tensor  # float32 [n, k / group]
    mins: torch.Tensor | None  # float32 [n, k / group], or None (w = d * q)
    quants: torch.Tensor  # [n, k]: uint8 (0..15 or 0..31) or int8
    group: int = 32  # weights per scale

    def dequantize(self) -> torch.Tensor:
        """float32 [n, k]: d * q (+ m), bit-equal to gguf's dequantization of the blocks."""
        n = self.quants.shape[0]
        q = self.quants.reshape(n, -1, self.group).float()  # each group against its scale
        w = self.scales.unsqueeze(-1) * q
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.view(n, -1)

    @classmethod
    def join(cls, parts: list[BlockParts]) -> BlockParts:
        """The rows of `parts` (of formats sharing one layout) as one weight's."""
        mins = [p.mins for p in parts]
        return cls(
            torch.cat([p.scales for p in parts]),
            None if mins[0] is None else torch.cat(mins),
            torch.cat([p.quants for p in parts]),
            parts[0].group,
        )

    def pack(self, kernels: ModuleType, layout: str) -> torch.Tensor:
        """The parts in `layout` for kernels.gguf_linear."""
        quants = self.quants.view(torch.uint8) if self.quants.dtype == torch.int8 else self.quants
        return kernels.pack_gguf_parts(self.scales, self.mins, quants.contiguous(), layout)


def _half(raw: torch.Tensor) -> torch.Tensor:
    """float32 of little-endian fp16 bytes [..., 2]."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., b] bytes to [..., 2b] 4-bit values: the low nibbles first, then the high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """[..., count // 8] little-endian bytes to [..., count] bits (bit i of byte i // 8 at i)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> shifts) & 1).reshape(*raw.shape[:-1], count)


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and minimums of a K-quant superblock's 8 sub-blocks, from its 12 bytes
    ([..., 12] -> two [..., 8])."""
    d, m, md = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales, mins


def decode(rows: torch.Tensor, type_name: str) -> BlockParts:
    """The parts of GGUF block rows (uint8 [n, bytes]) of `type_name` (a key of BLOCKS)."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGUF type {type_name} is not decoded here ({', '.join(BLOCKS)} are)")
    size, nbytes = BLOCKS[type_name]
    n = rows.shape[0]
    b = rows.reshape(n, -1, nbytes)
    if size == 256:
        return _decode_k(b, type_name)
    d = _half(b[..., 0:2])
    if type_name == "Q8_0":
        return BlockParts(d, None, b[..., 2:].contiguous().view(torch.int8).reshape(n, -1))
    m = _half(b[..., 2:4]) if type_name in ("Q4_1", "Q5_1") else None
    if type_name in ("Q4_0", "Q4_1"):
        q = _nibbles(b[..., 4:] if m is not None else b[..., 2:]).reshape(n, -1)
        return BlockParts(d, m if m is not None else -8 * d, q)
    start = 8 if m is not None else 6  # Q5_0, Q5_1: 4 bytes of fifth bits, then nibbles
    q = _nibbles(b[..., start:]) | (_bits(b[..., start - 4 : start], 32) << 4)
    if m is None:  # Q5_0: w = d * (q - 16)
        return BlockParts(d, None, (q.to(torch.int8) - 16).reshape(n, -1))
    return BlockParts(d, m, q.reshape(n, -1))


@dataclass
class KParts:
    """A Q4_K or Q5_K tensor's parts before their products: per superblock of 256 the fp16 d and
    dmin (float32 [n, k / 256]), per sub-block of 32 the 6-bit scale and minimum (uint8
    [n, k / 32]), a quant per weight (uint8 [n, k])."""

    d: torch.Tensor
    dmin: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    quants: torch.Tensor

    def parts(self) -> BlockParts:
        """w = (d * scale) * q - dmin * min, as a float32 d and m per 32 weights."""
        n = self.quants.shape[0]
        scales = (self.d.unsqueeze(-1) * self.scales.view(n, -1, 8).float()).reshape(n, -1)
        mins = -(self.dmin.unsqueeze(-1) * self.mins.view(n, -1, 8).float()).reshape(n, -1)
        return BlockParts(scales, mins, self.quants)


def k_parts(rows: torch.Tensor, type_name: str) -> KParts:
    """The parts of Q4_K or Q5_K block rows (uint8 [n, bytes])."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, BLOCKS[type_name][1])
    sc, mn = _k_scales(b[..., 4:16])
    if type_name == "Q4_K":
        # Each 32 bytes hold two sub-blocks: low nibbles the first, high nibbles the second.
        q = _nibbles(b[..., 16:].reshape(n, -1, 4, 32))
    else:
        high = _bits(b[..., 16:48].reshape(n, -1, 32, 1), 8)  # [n, sb, 32 bytes, 8 sub-blocks]
        q = _nibbles(b[..., 48:].reshape(n, -1, 4, 32)).reshape(n, -1, 8, 32)
        q = q | (high.transpose(-1, -2) << 4)
    return KParts(
        _half(b[..., 0:2]),
        _half(b[..., 2:4]),
        sc.reshape(n, -1),
        mn.reshape(n, -1),
        q.reshape(n, -1),
    )


def _decode_k(b: torch.Tensor, type_name: str) -> BlockParts:
    """Q4_K, Q5_K: superblocks of 256 weights, 8 sub-blocks of 32 with 6-bit scales and minimums
    of an fp16 d and dmin: w = (d * scale) * q - dmin * min; Q6_K."""
    if type_name == "Q6_K":
        return _decode_q6_k(b)
    return k_parts(b.reshape(b.shape[0], -1), type_name).parts()


def q6_k_parts(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K block rows (uint8 [n, bytes]) as (d float32 [n, k / 256], int8 scales [n, k / 16],
    quants + 32 uint8 [n, k] in 0..63): superblocks of 256 weights, 16 sub-blocks of 16 with
    int8 scales of an fp16 d (the block's last bytes), q of 4 low bits and 2 high bits."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, BLOCKS["Q6_K"][1])
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    low = b[..., :128].reshape(n, -1, 2, 1, 64) >> shifts
    high = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> torch.tensor(
        [0, 2, 4, 6], dtype=torch.uint8
    ).view(4, 1)
    q = (low & 0x0F).reshape(n, -1, 8, 32) | ((high & 0x03).reshape(n, -1, 8, 32) << 4)
    scales = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    return _half(b[..., 208:210]), scales, q.reshape(n, -1)


def _decode_q6_k(b: torch.Tensor) -> BlockParts:
    """Q6_K: w = (d * scale) * (q - 32) per sub-block of 16."""
    n = b.shape[0]
    d, scales, q = q6_k_parts(b.reshape(n, -1))
    products = (d.unsqueeze(-1) * scales.view(n, d.shape[1], 16).float()).reshape(n, -1)
    return BlockParts(products, None, (q.to(torch.int8) - 32), group=16)


def pack_int8(
    rows: torch.Tensor, type_name: str, k: int, kernels: ModuleType, half: bool = True
) -> tuple[torch.Tensor, str]:
    """GGUF block rows of `type_name` packed for the integer path: (data, the layout name
    kernels.gguf_linear takes, "<layout>+q8"). Q4_K and Q6_K in compact layouts of their own;
    the formats whose scales are float16 in the file keep them so (with `half`, where all are
    exact: Q4_0's minimums, -8 d, may not be)."""
    if type_name == "Q4_K":
        p = k_parts(rows, type_name)
        return kernels.pack_q4_k_q8(p.d, p.dmin, p.scales, p.mins, p.quants), "Q4_K+q8"
    if type_name == "Q6_K":
        return kernels.pack_q6_k_q8(*q6_k_parts(rows)), "Q6_K+q8"
    if type_name in ("Q5_0", "Q5_1") and half:
        p = decode(rows, type_name)
        quants = (p.quants.to(torch.int16) + (16 if p.mins is None else 0)).to(torch.uint8)
        return kernels.pack_q5_q8(p.scales, p.mins, quants), f"{type_name}+q8"
    data, layout = kernels.pack_q8_layout(
        pack_blocks(rows, type_name, k, kernels),
        LAYOUTS[type_name],
        rows.shape[0],
        k,
        half and type_name in HALF_SCALES,
    )
    return data, layout + "+q8"


def pack_blocks(rows: torch.Tensor, type_name: str, k: int, kernels: ModuleType) -> torch.Tensor:
    """GGUF block rows of `type_name` ([n, bytes]) packed for kernels.gguf_linear, which is then
    called with LAYOUTS[type_name]."""
    if type_name in STORED_LAYOUT:
        return kernels.pack_gguf_weight(rows, type_name, k)
    return decode(rows, type_name).pack(kernels, LAYOUTS[type_name])
