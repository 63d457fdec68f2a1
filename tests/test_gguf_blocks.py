"""GGUF block formats decoded in torch (spectral.layers.gguf_blocks) against gguf's own
dequantization, bit for bit, and served by gguf_linear exactly (float32 and cast bfloat16) on
every build this CPU runs: random blocks with extreme, zero and subnormal scales, all-zero and
saturated quants, over any shape."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.kernels.cpu_kernels import load_cpu_kernels
from spectral.layers.gguf_blocks import BLOCKS, LAYOUTS, BlockParts, decode, pack_blocks
from tests.test_cpu_kernels import NARROWER, float32_error_bound

kernels = load_cpu_kernels()
BUILDS = {"native": kernels, **{isa: load_cpu_kernels(isa) for isa in NARROWER}}
FORMATS = sorted(BLOCKS)
# fp16 scales from the ends of its range: the largest finite, the smallest subnormal, zeros.
EXTREME = np.array([65504.0, -65504.0, 2**-24, -(2**-24), 0.0, -0.0, 1.0], dtype=np.float16)


def scale_bytes(fmt: str) -> int:
    """How many fp16 scales a block of `fmt` holds (d, and m or dmin)."""
    return 2 if fmt in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1


def scale_offset(fmt: str) -> int:
    """Where a block's fp16 scales start (Q6_K keeps its d last)."""
    return 208 if fmt == "Q6_K" else 0


def random_blocks(fmt: str, n: int, blocks: int, seed: int, fill: str = "random") -> np.ndarray:
    """uint8 [n, blocks * bytes] of `fmt`: random quants (or all zero / all ones bits) under
    finite fp16 scales, some of them extreme."""
    size, nbytes = BLOCKS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, blocks, nbytes), dtype=np.uint8)
    if fill == "zero":
        raw[:] = 0
    elif fill == "saturated":
        raw[:] = 255
    scales = rng.standard_normal((n, blocks, scale_bytes(fmt))).astype(np.float16)
    pick = rng.random(scales.shape) < 0.2
    scales[pick] = rng.choice(EXTREME, pick.sum())
    at = scale_offset(fmt)
    raw[..., at : at + 2 * scale_bytes(fmt)] = scales.view(np.uint8).reshape(n, blocks, -1)
    return raw.reshape(n, -1)


def gguf_values(fmt: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, fmt)))


def expanded(build, packed: torch.Tensor, fmt: str, n: int, k: int, dtype: torch.dtype):
    """The weights as gguf_linear expands them: the identity times them is exactly them."""
    return build.gguf_linear(torch.eye(k, dtype=dtype), packed, LAYOUTS[fmt], n, None).T


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    n=st.integers(1, 40),
    blocks=st.integers(1, 4),
    fill=st.sampled_from(["random", "random", "zero", "saturated"]),
    seed=st.integers(0, 2**16),
)
def test_decoded_blocks_dequantize_bit_equal_to_gguf(fmt, n, blocks, fill, seed):
    raw = random_blocks(fmt, n, blocks, seed, fill)
    got = decode(torch.from_numpy(raw), fmt).dequantize()
    expected = gguf_values(fmt, raw)
    assert got.shape == expected.shape and torch.equal(got, expected)
    # Bit for bit, but for the sign of a zero: Q4_0's d * q - 8 d is +0 where gguf's
    # d * (q - 8) is -0 (the same in any sum).
    nonzero = expected != 0
    assert torch.equal(got.view(torch.int32)[nonzero], expected.view(torch.int32)[nonzero])


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_linear_expands_every_format_exactly(build, fmt):
    size = BLOCKS[fmt][0]
    for n, blocks, fill in ((37, 2, "random"), (5, 1, "zero"), (16, 1, "saturated")):
        raw = random_blocks(fmt, n, blocks, seed=n, fill=fill)
        k = size * blocks
        packed = pack_blocks(torch.from_numpy(raw), fmt, k, BUILDS[build])
        expected = gguf_values(fmt, raw)
        assert torch.equal(expanded(BUILDS[build], packed, fmt, n, k, torch.float32), expected)
        assert torch.equal(
            expanded(BUILDS[build], packed, fmt, n, k, torch.bfloat16), expected.bfloat16()
        )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 13, 64])
def test_gguf_linear_is_within_float32_error_of_float64_for_every_format(fmt, rows):
    """One row may sum d * sum(x q) + m * sum(x) per block: the bound counts |w| + 2 |m|."""
    size = BLOCKS[fmt][0]
    n, k = 40, 2 * size
    rng = np.random.default_rng(rows)
    raw = random_blocks(fmt, n, 2, seed=rows)
    b = raw.reshape(n, 2, -1)
    scales = (rng.standard_normal((n, 2, scale_bytes(fmt))) * 0.05).astype(np.float16)
    at = scale_offset(fmt)
    b[..., at : at + 2 * scale_bytes(fmt)] = scales.view(np.uint8).reshape(n, 2, -1)
    parts = decode(torch.from_numpy(raw), fmt)
    w = parts.dequantize()
    offsets = torch.zeros_like(w)
    if parts.mins is not None:
        offsets = parts.mins.abs().repeat_interleave(parts.group, dim=1)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = kernels.gguf_linear(x, parts.pack(kernels, LAYOUTS[fmt]), LAYOUTS[fmt], n, None)
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).abs() <= float32_error_bound(x, w.abs() + 2 * offsets)).all()


def test_formats_of_one_layout_join_into_one_weight():
    """A fused weight whose parts come in different formats of one layout (Q4_0 and Q4_K: the
    Q4_1 layout; Q5_1 and Q5_K: Q8_0m) expands to each part's own dequantization."""
    for formats, layout in ((("Q4_0", "Q4_K"), "Q4_1"), (("Q5_1", "Q5_K"), "Q8_0m")):
        raws = [
            random_blocks(fmt, 9, 256 // BLOCKS[fmt][0], seed=i) for i, fmt in enumerate(formats)
        ]
        parts = [decode(torch.from_numpy(raw), fmt) for raw, fmt in zip(raws, formats)]
        packed = BlockParts.join(parts).pack(kernels, layout)
        got = kernels.gguf_linear(torch.eye(256), packed, layout, 18, None).T
        assert torch.equal(got, torch.cat([gguf_values(f, r) for f, r in zip(formats, raws)]))


def test_a_format_not_decoded_here_is_refused_with_the_ones_that_are():
    with pytest.raises(ValueError, match=r"Q3_K is not decoded here \(Q4_0, .*Q6_K are\)"):
        decode(torch.zeros(1, 110, dtype=torch.uint8), "Q3_K")
    parts = decode(torch.from_numpy(random_blocks("Q5_0", 2, 1, seed=0)), "Q5_0")
    with pytest.raises(RuntimeError, match="Q8_0m layout needs mins"):
        kernels.pack_gguf_parts(parts.scales, None, parts.quants.view(torch.uint8), "Q8_0m")
