"""The integer path over GGUF blocks (`--quantization gguf-int8`) against a NumPy reference of
the same arithmetic, bit for bit, on every build this CPU runs: activations quantized per block
of 32 (q = rint(x * 127 / amax), d = amax / 127, s = sum q), integer block sums, and their float32
combination block after block (u = dw * isum (+ mw * s), acc = acc + d * u); for Q4_K and Q6_K
activations per superblock of 256 (its step, each block on it or up to 8 times finer), the blocks'
sums times their integer scales and steps added in int32 and combined in float32 once a
superblock. Every format, 1..65 rows; a row's result the
same alone or among 64 at any position."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.kernels.cpu_kernels import KERNEL_DIR, load_cpu_kernels
from spectral.layers.gguf_blocks import (
    BLOCKS,
    BlockParts,
    decode,
    k_parts,
    pack_blocks,
    pack_int8,
    q6_k_parts,
)
from tests.test_cpu_kernels import NARROWER, cpu_flags
from tests.test_gguf_blocks import random_blocks

kernels = load_cpu_kernels()
# Where the CPU has AVX2, also the VNNI tiles with vpdpbusd emulated (int8_dot.h): what a CPU
# with VNNI runs natively, tested here on one without it.
VNNI_EMULATED = {"vnni_emulated": 256} if "avx2" in cpu_flags() else {}
BUILDS = {
    "native": kernels,
    **{isa: load_cpu_kernels(isa) for isa in {**NARROWER, **VNNI_EMULATED}},
}
# The tiles' vectors are 512 bits wide where the CPU has AVX-512 BW, and take VNNI in that width.
HAS_VNNI = (
    "avx512_vnni" in cpu_flags()
    if {"avx512bw", "avx512vl"} <= cpu_flags()
    else {"avx512_vnni", "avx512vl"} <= cpu_flags() or "avx_vnni" in cpu_flags()
)
FORMATS = sorted(BLOCKS)
F32 = np.float32


def quantize_reference(x: np.ndarray, superblocks: bool = False) -> tuple[np.ndarray, ...]:
    """float32 [m, k] -> (q int8 [m, k], d float32 [m, k / 32], s int32 [m, k / 32]); with
    `superblocks`, d the superblock's (amax / 127 of its 256 inputs) and each block quantized on
    that step / 2^e, the largest e <= 3 its own amax allows, and a fourth: shift = 3 - e."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    top = np.repeat(amax.reshape(m, k // 256, 8).max(axis=-1), 8, -1) if superblocks else amax
    e = np.zeros_like(amax, dtype=np.int32)
    if superblocks:
        for finer in (1, 2, 3):
            e = np.where(amax * F32(2**finer) <= top, finer, e)
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, F32(127) / top, F32(0)).astype(F32)
    inv = (inv * (2.0**e).astype(F32)).astype(F32)
    q = np.rint(blocks * inv[..., None]).astype(np.int32)
    out = q.reshape(m, k).astype(np.int8), (top / F32(127)).astype(F32), q.sum(-1, dtype=np.int32)
    return (*out, (3 - e).astype(np.int8)) if superblocks else out


def linear_reference(x: np.ndarray, parts: BlockParts, raw=None, fmt: str = "") -> np.ndarray:
    """float32 [m, n]: x quantized, dotted with the parts' quants per block of 32 in integers,
    combined in float32 block after block; Q4_K and Q6_K (`raw` blocks of `fmt`) as
    k_linear_reference."""
    if fmt in ("Q4_K", "Q6_K"):
        return k_linear_reference(x, raw, fmt)
    q, d, s = quantize_reference(x)
    m, k = x.shape
    nb = k // 32
    xq = q.astype(np.int64).reshape(m, nb, 32)
    wq = parts.quants.numpy().astype(np.int64).reshape(-1, nb, 32)
    scales = parts.scales.numpy()
    mins = None if parts.mins is None else parts.mins.numpy()
    halves = parts.group == 16
    if halves:
        first = np.einsum("mbj,nbj->mnb", xq[..., :16], wq[..., :16]).astype(F32)
        last = np.einsum("mbj,nbj->mnb", xq[..., 16:], wq[..., 16:]).astype(F32)
    else:
        isum = np.einsum("mbj,nbj->mnb", xq, wq).astype(F32)
    acc = np.zeros((m, wq.shape[0]), F32)
    for b in range(nb):
        if halves:
            u = scales[:, 2 * b] * first[:, :, b] + scales[:, 2 * b + 1] * last[:, :, b]
        else:
            u = scales[:, b] * isum[:, :, b]
            if mins is not None:
                u = u + mins[:, b] * s[:, b, None].astype(F32)
        acc = acc + d[:, b, None] * u
    return acc


def k_linear_reference(x: np.ndarray, raw: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [m, n] through Q4_K or Q6_K blocks: x quantized per superblock, each block's (Q6_K:
    each half's) integer sums times its integer scale and 2^shift added over the superblock (I;
    Q4_K also M, the minimums times x's block sums and 2^shift), then u = d * I (+ -dmin * M),
    acc = acc + (dx / 8) * u."""
    q, d, s, shift = quantize_reference(x, superblocks=True)
    times = np.left_shift(1, shift.astype(np.int64))  # [m, k / 32]
    m, k = x.shape
    rows = torch.from_numpy(raw)
    if fmt == "Q4_K":
        p = k_parts(rows, fmt)
        wq, group = p.quants.numpy().astype(np.int64), 32
        scales, scale, low = p.scales.numpy().astype(np.int64), p.d.numpy(), -p.dmin.numpy()
    else:
        scale, q6_scales, quants = (t.numpy() for t in q6_k_parts(rows))
        wq, group, scales = quants.astype(np.int64) - 32, 16, q6_scales.astype(np.int64)
    groups = k // group
    isum = np.einsum(
        "mgj,ngj->mng", q.astype(np.int64).reshape(m, groups, group), wq.reshape(-1, groups, group)
    )
    block_times = np.repeat(times, 32 // group, -1)[:, None]  # each group's block's 2^shift
    sums = (isum * scales[None] * block_times).reshape(m, -1, k // 256, 256 // group).sum(-1)
    if fmt == "Q4_K":
        mins = p.mins.numpy().astype(np.int64)[None] * (s.astype(np.int64) * times)[:, None]
        mins = mins.reshape(m, -1, k // 256, 8).sum(-1)
    assert np.abs(sums).max(initial=0) < 2**31  # the tiles' int32 sums
    acc = np.zeros((m, wq.shape[0]), F32)
    for sb in range(k // 256):
        u = scale[:, sb] * sums[:, :, sb].astype(F32)
        if fmt == "Q4_K":
            u = u + low[:, sb] * mins[:, :, sb].astype(F32)
        acc = acc + (d[:, 8 * sb, None] * F32(1 / 8)) * u
    return acc


def int8_linear(build, x: torch.Tensor, raw: np.ndarray, fmt: str) -> torch.Tensor:
    """x through the integer path over `raw` blocks of `fmt`, packed as a model's are."""
    data, layout = pack_int8(torch.from_numpy(raw), fmt, x.shape[1], build)
    return build.gguf_linear(x, data, layout, raw.shape[0], None)


def test_the_tiles_add_products_with_vnni_where_the_cpu_has_it():
    assert kernels.int8_vnni() == (1 if HAS_VNNI else 0)
    if VNNI_EMULATED:
        assert BUILDS["vnni_emulated"].int8_vnni() == 2
        assert BUILDS["vnni_emulated"].vector_bits() == 256


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_the_int8_peak_is_a_rate_where_the_build_has_vectors_and_zero_where_not(build):
    peak = BUILDS[build].int8_peak_macs(0.02)
    assert peak > 0 if BUILDS[build].vector_bits() else peak == 0


@pytest.mark.parametrize(
    "flags, vnni, bits",
    [
        (["-mavx2"], 0, 256),
        (["-mavx2", "-mavx512f", "-mavx512vl", "-mavx512vnni"], 1, 256),
        (["-mavx2", "-mavx512f", "-mavx512vl", "-mavx512bw"], 0, 512),
        (["-mavx2", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"], 1, 512),
        (["-mavx2", "-mavxvnni"], 1, 256),
        (["-mavx2", "-DSPECTRAL_VNNI_EMULATED"], 2, 256),
    ],
    ids=["avx2", "avx512-vnni-256", "avx512bw", "avx512bw-vnni", "avx-vnni", "emulated"],
)
def test_the_dot_product_compiles_for_every_instruction_set(flags, vnni, bits, tmp_path):
    """The forms this CPU may not run at least compile, with their instructions, under the flags
    of the CPUs that have them: VNNI or maddubs, in 256- or 512-bit vectors (the emulated build
    above runs the same tile code)."""
    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (the CPU kernels do not build either)")
    source = tmp_path / "dot.cpp"
    source.write_text(
        f"""#include "int8_dot.h"
using namespace spectral_cpu;
static_assert(kVnni == {vnni}, "kVnni");
static_assert(sizeof(IVec) * 8 == {bits}, "the vectors' width");
IVec run(IVec u, IVec s) {{
  DotSum sum;
  sum.add(u, s);
  return dot4_add(iv::sign8(sum.widen(), u), u, s);
}}
"""
    )
    cmd = [compiler, "-std=c++20", "-O1", "-S", *flags, "-I", str(KERNEL_DIR), str(source)]
    done = subprocess.run(
        [*cmd, "-o", str(tmp_path / "dot.s")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    asm = (tmp_path / "dot.s").read_text()
    assert ("vpdpbusd" in asm) == (vnni == 1)
    assert ("vpmaddubsw" in asm) == (vnni == 0)
    assert ("zmm" in asm) == (bits == 512)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_activation_quantization_equals_the_reference(build):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((9, 96), generator=gen) * torch.logspace(-30, 30, 9)[:, None]
    x[3, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[4, 5] = 1e30  # one huge value: the rest of its block rounds to 0
    # halves, where rounding to the nearest even integer and away from zero differ (amax 127:
    # x * 127 / amax is x itself)
    x[5, 32:64] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] * 4)
    q, d, s = BUILDS[build].quantize_q8(x)
    eq, ed, es = quantize_reference(x.numpy())
    assert np.array_equal(q.numpy(), eq) and np.array_equal(s.numpy(), es)
    assert np.array_equal(d.numpy().view(np.int32), ed.view(np.int32))
    assert int(q.abs().max()) == 127
    # per superblock (the K-quant tiles' input): each block of a row's 256 inputs on the step of
    # their amax, or 2, 4 or 8 times finer where its own amax allows
    wide = torch.cat([x, x.flip(0) * 1e-3, x * 3.0, torch.zeros(9, 96), x[:, :64], x[:, 32:]], 1)
    for block, top in enumerate([8.0, 8.0, 4.0, 2.0, 1.0, 0.5, 3.0, 6.0]):
        wide[0, 32 * block : 32 * block + 32] = 0.25
        wide[0, 32 * block + 7] = top  # the block's amax against the superblock's 8
    got = BUILDS[build].quantize_q8(wide, True)
    expected = quantize_reference(wide.numpy(), superblocks=True)
    for name, a, b in zip(("q", "d", "s", "shift"), got, expected):
        assert np.array_equal(a.numpy().view(b.dtype), b), name
    assert expected[3][0, :8].tolist() == [3, 3, 2, 1, 0, 0, 2, 3]  # steps 8 / 2^(3 - shift)
    assert not np.array_equal(expected[0], quantize_reference(wide.numpy())[0])


@settings(max_examples=50, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    n=st.integers(1, 40),
    blocks=st.integers(1, 3),
    m=st.integers(1, 65),
    fill=st.sampled_from(["random", "random", "random", "zero", "saturated"]),
    seed=st.integers(0, 2**16),
)
def test_int8_linear_equals_the_numpy_reference_on_every_build(fmt, n, blocks, m, fill, seed):
    raw = random_blocks(fmt, n, blocks, seed, fill)
    parts = decode(torch.from_numpy(raw), fmt)
    k = parts.quants.shape[1]
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(seed))
    expected = linear_reference(x.numpy(), parts, raw, fmt)
    for name, build in BUILDS.items():
        got = int8_linear(build, x, raw, fmt).numpy()
        assert np.array_equal(got, expected, equal_nan=True), f"{name} build, {fmt}"
    got16 = int8_linear(kernels, x.bfloat16(), raw, fmt)
    assert got16.dtype == torch.bfloat16
    reference16 = linear_reference(x.bfloat16().float().numpy(), parts, raw, fmt)
    assert torch.equal(got16, torch.from_numpy(reference16).bfloat16())


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "Q5_K"])
def test_a_row_is_the_same_alone_or_among_64_at_any_position(fmt):
    raw = random_blocks(fmt, 37, 2 if BLOCKS[fmt][0] == 32 else 1, 5)
    k = decode(torch.from_numpy(raw), fmt).quants.shape[1]
    x = torch.randn((64, k), generator=torch.Generator().manual_seed(1))
    together = int8_linear(kernels, x, raw, fmt)
    for row in (0, 1, 5, 31, 62, 63):
        alone = int8_linear(kernels, x[row : row + 1], raw, fmt)
        assert torch.equal(alone[0], together[row])
        moved = torch.roll(x, shifts=17, dims=0)  # the same row at another position
        assert torch.equal(int8_linear(kernels, moved, raw, fmt)[(row + 17) % 64], together[row])


def test_the_integer_path_stays_close_to_the_exact_one():
    """Not an oracle of its own (the reference above is): the 8-bit activations keep a Q4_K
    matmul within 1% of the exact path's norm."""
    raw = random_blocks("Q4_K", 64, 2, 9)
    x = torch.randn((8, 512), generator=torch.Generator().manual_seed(2))
    exact = x @ decode(torch.from_numpy(raw), "Q4_K").dequantize().T
    rel = (int8_linear(kernels, x, raw, "Q4_K") - exact).norm() / exact.norm()
    assert float(rel) < 0.01


def test_q4_k_takes_its_compact_layout_and_the_exact_path_refuses_it():
    """Q4_K on the integer path: 0.59 bytes a weight (the file's 0.56; Q4_1's layout 0.75)."""
    raw = random_blocks("Q4_K", 64, 2, 3)
    data, layout = pack_int8(torch.from_numpy(raw), "Q4_K", 512, kernels)
    assert layout == "Q4_K+q8" and data.numel() / (64 * 512) < 0.6
    with pytest.raises(RuntimeError, match="Q4_K"):
        kernels.gguf_linear(torch.ones(1, 512), data, "Q4_K", 64, None)
    with pytest.raises(RuntimeError, match="pack_q4_k_q8"):
        kernels.pack_q8_layout(
            pack_blocks(torch.from_numpy(raw), "Q4_K", 512, kernels), "Q4_K", 64, 512, True
        )


@pytest.mark.parametrize(
    ("fmt", "layout", "size"),
    [
        ("Q4_1", "Q4_1f16+q8", 0.625),
        ("Q4_0", "Q4_1f16+q8", 0.625),
        ("Q8_0", "Q8_0f16+q8", 1.0625),
        ("Q5_0", "Q5_0+q8", 0.6875),
        ("Q5_1", "Q5_1+q8", 0.75),
    ],
)
def test_file_scales_stay_float16_and_fall_back_to_float32_where_one_is_not(fmt, layout, size):
    """Q4_1 keeps the file's float16 d and m (0.625 bytes a weight against 0.75 in float32),
    Q5_0 and Q5_1 the file's size (nibbles and a plane of fifth bits, against 1.06 and 1.13 as
    8-bit quants); a Q4_0 block whose minimum -8 d is beyond float16's range takes float32
    scales, and all hold to the reference."""
    raw = random_blocks(fmt, 48, 2, 8)
    nbytes = BLOCKS[fmt][1]
    for b in range(2):  # ordinary d (and m): random_blocks makes some extreme
        raw[:, b * nbytes : b * nbytes + 4] = np.array([1.5, 0.25], np.float16).view(np.uint8)
    data, got_layout = pack_int8(torch.from_numpy(raw), fmt, 64, kernels)
    width = kernels.packed_panel_width()  # rows are packed in whole panels (16 or 32 rows)
    assert got_layout == layout and data.numel() == size * (-(-48 // width) * width) * 64
    if fmt == "Q4_0":
        raw[7, :2] = np.array([9000.0], np.float16).view(np.uint8)  # -8 d = -72000
        data, got_layout = pack_int8(torch.from_numpy(raw), fmt, 64, kernels)
        assert got_layout == "Q4_1+q8"
    x = torch.randn((3, 64), generator=torch.Generator().manual_seed(3))
    expected = linear_reference(x.numpy(), decode(torch.from_numpy(raw), fmt))
    assert np.array_equal(kernels.gguf_linear(x, data, got_layout, 48, None).numpy(), expected)


def test_quants_beyond_a_layouts_int16_sums_are_refused():
    parts = BlockParts(
        torch.ones(4, 1), torch.zeros(4, 1), torch.full((4, 32), 40, dtype=torch.uint8)
    )
    packed = parts.pack(kernels, "Q8_0m")
    with pytest.raises(RuntimeError, match="Q8_0m"):
        kernels.pack_q8_layout(packed, "Q8_0m", 4, 32, False)


def test_a_weight_in_parts_quantizes_x_once_and_equals_its_parts_side_by_side():
    """A Q4_K_M q|k|v: Q4_K rows over Q8_0 rows (x quantized per block of 32 beside per
    superblock) over Q6_K rows (and a dense part), each part's columns written in place,
    through linear_parts: bit for bit the parts' own outputs side by side, plus the bias."""
    x = torch.randn((5, 512), generator=torch.Generator().manual_seed(4))
    raws = {
        fmt: random_blocks(fmt, rows, 512 // BLOCKS[fmt][0], 6)
        for fmt, rows in (("Q4_K", 48), ("Q8_0", 24), ("Q6_K", 16))
    }
    parts = [
        (*pack_int8(torch.from_numpy(raw), fmt, 512, kernels), raw.shape[0])
        for fmt, raw in raws.items()
    ]
    dense = torch.randn((8, 512), generator=torch.Generator().manual_seed(5))
    parts.append((kernels.pack_linear_weight(dense), "", 8))
    bias = torch.randn(96)
    got = kernels.linear_parts(x, *map(list, zip(*parts)), bias)
    singles = [
        kernels.gguf_linear(x, d, t, n, None) if t else kernels.packed_linear(x, d, n, None)
        for d, t, n in parts
    ]
    assert torch.equal(got, torch.cat(singles, dim=1) + bias)
