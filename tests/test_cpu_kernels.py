"""spectral's C++ CPU kernels against their PyTorch references."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.attention.torch_backend import TorchAttentionBackend
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.kernels import cpu_kernels as kernel_builds
from spectral.kernels.cpu_kernels import BUILD_ERRORS, cpu_flags, load_cpu_kernels
from spectral.layers.norm import RMSNorm
from spectral.layers.rotary import apply_rotary
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool

kernels = load_cpu_kernels()
# torch builds with $CXX, else c++: without one the kernels are optional and these tests skip;
# with one, a build that fails is a failure (test_the_kernels_build_where_a_compiler_is)
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
pytestmark = pytest.mark.skipif(
    kernels is None and not HAS_COMPILER, reason="no C++ compiler to build the CPU kernels"
)


def test_the_kernels_build_where_a_compiler_is():
    assert kernels is not None, f"the CPU kernels did not build: {BUILD_ERRORS.get('native')}"


DTYPES = [torch.float32, torch.bfloat16]


def bf16_tolerance(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """Float32 sums in another order, then one rounding to the output dtype."""
    scale = reference.abs().max().item()
    return scale * (1e-5 if dtype == torch.float32 else 2**-7)


def test_kernels_use_the_widest_vector_unit_the_cpu_has():
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    want = 512 if "avx512f" in flags else 256 if {"avx2", "fma"} <= flags else 0
    assert kernels.vector_bits() == want


@pytest.mark.parametrize(
    "vendor, family, flags, locality, min_rows, ahead",
    [
        ("GenuineIntel", 6, "fpu avx2 avx512f", 3, 1, 1024),
        ("AuthenticAMD", 25, "fpu avx2 avx512f avx512bw", 0, 2, 1024),
        ("AuthenticAMD", 26, "fpu avx2 avx512f avx512bw", 0, 1, 4096),
        ("AuthenticAMD", 23, "fpu avx2 fma", 0, 1, 1024),
    ],
)
def test_weights_are_asked_for_ahead_as_measured_for_the_cpu(
    monkeypatch, vendor, family, flags, locality, min_rows, ahead
):
    """Non-temporal hints on AMD, into every level on Intel; one-row integer tiles without
    them only on a Zen 4 (an AMD with AVX-512 before family 26); 4 KiB ahead on a Zen 5
    (vec.h's prefetch_ahead, prefetch_for_rows)."""
    lines = (
        "processor\t: 0",
        f"vendor_id\t: {vendor}",
        f"cpu family\t: {family}",
        f"flags\t\t: {flags}",
    )
    monkeypatch.setattr(kernel_builds, "cpuinfo_lines", lambda: lines)
    assert kernel_builds.prefetch_locality() == locality
    assert kernel_builds.prefetch_min_rows() == min_rows
    assert kernel_builds.prefetch_ahead() == ahead


def test_the_runtime_build_asks_ahead_as_chosen_for_this_cpu():
    native = kernel_builds.ISA_FLAGS["native"]
    for define in (
        f"SPECTRAL_PREFETCH_LOCALITY={kernel_builds.prefetch_locality()}",
        f"SPECTRAL_PREFETCH_MIN_ROWS={kernel_builds.prefetch_min_rows()}",
        f"SPECTRAL_PREFETCH_AHEAD={kernel_builds.prefetch_ahead()}",
    ):
        assert f"-D{define}" in native


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576)
    norm = norm.to(dtype)
    x = (torch.randn(7, 576) * 3).to(dtype)
    residual = torch.randn(7, 576).to(dtype)
    want_normed, want_sum = norm(x, residual.clone())
    norm.kernels = kernels
    got_normed, got_sum = norm(x, residual.clone())
    assert torch.equal(got_sum, want_sum)
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    assert torch.allclose(got_normed.float(), want_normed.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_inplace_matches_reference(dtype):
    torch.manual_seed(1)
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    positions = torch.tensor([0, 3, 17, 100, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(4096).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    q = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    c, s = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
    want_q, want_k = apply_rotary(q, c, s), apply_rotary(k, c, s)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    kernels.rotary_inplace(qkv, heads + kv_heads, dim, cos, sin, positions)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    got_q = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    got_k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    assert torch.allclose(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    assert torch.allclose(got_k.float(), want_k.float(), rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    """silu(gate) * up of a fused gate|up row block, tails past the vector width and extreme
    gates (exp over- and underflow) included."""
    check_silu_mul(dtype, kernels)


def check_silu_mul(dtype: torch.dtype, kernels) -> None:
    torch.manual_seed(3)
    gate_up = (torch.randn(5, 2 * 77) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, 0.0, 88.0, 200.0, -0.0]).to(dtype)
    gate, up = gate_up.split(77, dim=1)
    expected = torch.nn.functional.silu(gate) * up
    got = kernels.silu_mul(gate_up)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert got.dtype == dtype and got.shape == (5, 77)
    assert torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol)


def check_argmax_rows(build) -> None:
    """Each row's argmax against NumPy's (the first of equal largest values, the first NaN):
    widths around the vector lanes and a vocabulary's, ties, NaNs, infinities, signed zeros,
    strided rows."""
    rng = np.random.default_rng(5)
    for width in (1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 49152):
        x = rng.standard_normal((9, width)).astype(np.float32)
        x[1] = np.round(x[1])  # ties
        x[2, rng.integers(0, width)] = np.nan
        x[3] = -np.inf
        x[4] = 0.0
        x[4, width // 2] = -0.0
        x[5, width - 1] = np.inf
        x[6, -1:] = np.nan  # in the scalar tail
        if width > 3:
            x[7, [1, 3]] = np.nan
            x[7, 0] = np.inf
        x[8] = x[8].max() + 1.0
        got = build.argmax_rows(torch.from_numpy(x))
        assert got.dtype == torch.int64
        assert got.tolist() == np.argmax(x, axis=1).tolist(), width
    wide = torch.from_numpy(rng.standard_normal((6, 80)).astype(np.float32))
    assert (
        build.argmax_rows(wide[::2, 3:70]).tolist()
        == np.argmax(wide.numpy()[::2, 3:70], 1).tolist()
    )
    with pytest.raises(RuntimeError, match="float32 CPU logits"):
        build.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="each row contiguous"):
        build.argmax_rows(torch.zeros(8, 2).t())


def test_argmax_rows_matches_numpy():
    check_argmax_rows(kernels)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_the_torch_backend(dtype):
    """A batch of decode queries over scattered slots with different lengths."""
    torch.manual_seed(2)
    heads, kv_heads, dim = 9, 3, 64
    pool = KVPool(512, 1, kv_heads, dim, dtype)
    table = ReqToTokenPool(4, 128)
    lens = [5, 40, 1]
    slots = torch.randperm(511)[: sum(lens)] + 1
    offset = 0
    for row, n in enumerate(lens):
        prefix = slots[offset : offset + n - 1]
        pool.k[0][prefix] = torch.randn(n - 1, kv_heads, dim).to(dtype)
        pool.v[0][prefix] = torch.randn(n - 1, kv_heads, dim).to(dtype)
        table.write(row, 0, slots[offset : offset + n])
        offset += n
    new_loc = torch.tensor([slots[sum(lens[: i + 1]) - 1] for i in range(3)])
    q = torch.randn(3, heads, dim).to(dtype)
    k = torch.randn(3, kv_heads, dim).to(dtype)
    v = torch.randn(3, kv_heads, dim).to(dtype)

    def run(backend_kernels):
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(3, dtype=torch.long),
            positions=torch.tensor([n - 1 for n in lens]),
            out_cache_loc=new_loc,
            req_pool_indices=torch.tensor([0, 1, 2]),
            prefix_lens=[n - 1 for n in lens],
            extend_lens=[1, 1, 1],
        )
        backend = TorchAttentionBackend(pool, table, dim**-0.5, backend_kernels)
        backend.init_forward_metadata(batch)
        return backend.forward(q, k, v, 0, batch)

    expected = run(None)
    got = run(kernels)
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    assert torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_over_trees_reads_shared_prefixes_once_and_matches_a_reference(dtype):
    """Rows of verified trees: two requests' nodes, each over its request's prefix (long
    enough to be shared) and its own ancestors, one tree larger than a group of rows, beside a
    row of a third request; against float64 softmax(q k^T) v per row and head."""
    torch.manual_seed(5)
    heads, kv_heads, dim, slots = 9, 3, 64, 400
    k_buf = torch.randn(slots, kv_heads, dim).to(dtype)
    v_buf = torch.randn(slots, kv_heads, dim).to(dtype)
    perm = torch.randperm(slots)
    rows: list[list[int]] = []
    used = 0
    for prefix, nodes in ((40, 11), (70, 3), (5, 1)):
        base = perm[used : used + prefix].tolist()
        tree = perm[used + prefix : used + prefix + nodes].tolist()
        used += prefix + nodes
        parents = [-1] + [torch.randint(0, j, ()).item() for j in range(1, nodes)]
        for j in range(nodes):
            path, node = [], j
            while node >= 0:
                path.append(tree[node])
                node = parents[node]
            rows.append(base + path[::-1])
    longest = max(len(r) for r in rows)
    indices = torch.zeros(len(rows), longest, dtype=torch.int64)
    for i, r in enumerate(rows):
        indices[i, : len(r)] = torch.tensor(r)
    lens = torch.tensor([len(r) for r in rows])
    q = torch.randn(len(rows), heads, dim).to(dtype)
    got = kernels.decode_attention(q, k_buf, v_buf, indices, lens, dim**-0.5)
    for i, r in enumerate(rows):
        expected = attention_reference(q[i], k_buf, v_buf, r)
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        assert torch.allclose(got[i].double(), expected, rtol=tol, atol=tol), i


def attention_reference(q: torch.Tensor, k_buf, v_buf, keys: list[int]) -> torch.Tensor:
    """softmax(q k^T / sqrt(dim)) v in float64 for one row q [heads, dim] over slots `keys`."""
    heads, dim = q.shape
    group = heads // k_buf.shape[1]
    k = k_buf[keys].double().repeat_interleave(group, dim=1)  # [L, heads, dim]
    v = v_buf[keys].double().repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * dim**-0.5, -1)
    return torch.einsum("hl,lhd->hd", weights, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 48])
def test_prefill_rows_match_a_reference_and_each_row_computed_alone(dtype, dim):
    """Prefill rows (extend_lens): two requests' new tokens after their prefixes, causal, one
    long enough for the larger row groups; each row against a float64 reference, and bit-equal
    to the same row computed alone as a decode row and to the rows of the same request split
    into two batches at another point (a row does not depend on how a prompt is split)."""
    check_prefill_rows(dtype, dim, kernels)


def check_prefill_rows(dtype: torch.dtype, dim: int, kernels) -> None:
    torch.manual_seed(11)
    heads, kv_heads, slots = 6, 2, 700
    k_buf = torch.randn(slots, kv_heads, dim).to(dtype)
    v_buf = torch.randn(slots, kv_heads, dim).to(dtype)
    perm = torch.randperm(slots)
    requests = [(perm[:330], 30), (perm[330:351], 0)]  # (slots, prefix)
    width = max(len(s) for s, _ in requests)
    table = torch.zeros(len(requests), width, dtype=torch.int64)
    for j, (s, _) in enumerate(requests):
        table[j, : len(s)] = s
    lens = torch.tensor([len(s) for s, _ in requests])
    ext = torch.tensor([len(s) - p for s, p in requests])
    q = torch.randn(int(ext.sum()), heads, dim).to(dtype)
    scale = dim**-0.5
    got = kernels.decode_attention(q, k_buf, v_buf, table, lens, scale, ext)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    row = 0
    for s, prefix in requests:
        for i in range(len(s) - prefix):
            keys = s[: prefix + i + 1]
            expected = attention_reference(q[row], k_buf, v_buf, keys.tolist())
            assert torch.allclose(got[row].double(), expected, rtol=tol, atol=tol), row
            alone = kernels.decode_attention(
                q[row : row + 1],
                k_buf,
                v_buf,
                keys[None].contiguous(),
                torch.tensor([len(keys)]),
                scale,
            )
            assert torch.equal(alone[0], got[row]), row
            row += 1
    # The first request's new tokens in two batches, split after 117 of them.
    s, prefix = requests[0]
    first = kernels.decode_attention(
        q[:117],
        k_buf,
        v_buf,
        s[None, : prefix + 117].contiguous(),
        torch.tensor([prefix + 117]),
        scale,
        torch.tensor([117]),
    )
    rest = kernels.decode_attention(
        q[117:300],
        k_buf,
        v_buf,
        s[None].contiguous(),
        torch.tensor([len(s)]),
        scale,
        torch.tensor([183]),
    )
    assert torch.equal(torch.cat([first, rest]), got[:300])


def test_prefill_rows_refuse_lengths_outside_their_slots():
    k_buf = torch.randn(16, 1, 64)
    q = torch.randn(5, 1, 64)
    table = torch.arange(8)[None]
    with pytest.raises(RuntimeError, match="extends 5 tokens of 9 in rows of 8 slots"):
        kernels.decode_attention(
            q, k_buf, k_buf, table, torch.tensor([9]), 0.125, torch.tensor([5])
        )
    with pytest.raises(RuntimeError, match="q has 5 rows, the slots 4"):
        kernels.decode_attention(
            q, k_buf, k_buf, table, torch.tensor([8]), 0.125, torch.tensor([4])
        )


def float32_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far a float32 dot product of length k may be from the exact one: k units of float32
    roundoff times the sum of the products' magnitudes (the standard summation bound)."""
    k = x.shape[1]
    return k * 2**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30


def check_packed_linear(
    m: int, n: int, k: int, dtype: torch.dtype, seed: int, build=kernels
) -> None:
    torch.manual_seed(seed)
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    exact = x.double() @ w.double().T
    got = build.packed_linear(x, build.pack_linear_weight(w), n, None)
    assert got.dtype == dtype and got.shape == (m, n)
    error = (got.double() - exact).abs()
    bound = float32_error_bound(x, w)
    if dtype == torch.bfloat16:  # then one rounding to bfloat16: half a unit in the last place
        bound = bound + exact.abs() * 2**-8
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 17, 31, 64, 65])
@pytest.mark.parametrize("n, k", [(96, 64), (200, 576), (70, 1000), (33, 17), (1, 1)])
def test_packed_linear_is_within_float32_error_of_float64(dtype, rows, n, k):
    check_packed_linear(rows, n, k, dtype, seed=rows * n + k)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 70),
    n=st.integers(1, 80),
    k=st.integers(1, 130),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_linear_holds_for_any_shape(m, n, k, bf16, seed):
    check_packed_linear(m, n, k, torch.bfloat16 if bf16 else torch.float32, seed)


def test_packed_linear_adds_the_bias_and_refuses_mismatches_with_a_message():
    w, x, bias = torch.randn(40, 24), torch.randn(3, 24), torch.randn(40)
    packed = kernels.pack_linear_weight(w)
    width = kernels.packed_panel_width()
    assert width == 2 * max(kernels.vector_bits(), 256) // 32
    assert packed.shape == (-(-40 // width), 24, width)
    got = kernels.packed_linear(x, packed, 40, bias)
    assert torch.allclose(got, x @ w.T + bias, atol=1e-5)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.packed_linear(torch.randn(3, 25), packed, 40, None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels.packed_linear(x.bfloat16(), packed, 40, None)


GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def gguf_blocks(n: int, k: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized by gguf: the blocks (uint8 rows) and gguf's dequantization."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return torch.from_numpy(blocks), torch.from_numpy(gguf.quants.dequantize(blocks, qtype))


def expanded(
    packed: torch.Tensor, kind: str, n: int, k: int, dtype: torch.dtype, build=kernels
) -> torch.Tensor:
    """The weights as the kernel expands them: the identity times them is exactly them."""
    return build.gguf_linear(torch.eye(k, dtype=dtype), packed, kind, n, None).T


def check_gguf_expansion(kind: str, n: int, k: int, build=kernels) -> None:
    blocks, reference = gguf_blocks(n, k, kind, seed=n + k)
    packed = build.pack_gguf_weight(blocks, kind, k)
    assert torch.equal(expanded(packed, kind, n, k, torch.float32, build), reference)
    assert torch.equal(expanded(packed, kind, n, k, torch.bfloat16, build), reference.bfloat16())


@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("n, k", [(16, 32), (33, 64), (70, 96), (5, 576)])
def test_gguf_blocks_expand_to_ggufs_own_dequantization(kind, n, k):
    check_gguf_expansion(kind, n, k)


@pytest.fixture(scope="module")
def default_gguf() -> gguf.GGUFReader:
    from spectral.models.resolve import default_model_file

    return gguf.GGUFReader(default_model_file())


@pytest.mark.parametrize(
    "name", ["blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"]
)
def test_the_default_models_blocks_expand_to_ggufs_own_dequantization(name, default_gguf):
    tensor = next(t for t in default_gguf.tensors if t.name == name)
    rows = torch.from_numpy(np.array(tensor.data[:200]))
    k = int(tensor.shape[0])
    reference = torch.from_numpy(gguf.quants.dequantize(rows.numpy(), tensor.tensor_type))
    packed = kernels.pack_gguf_weight(rows, tensor.tensor_type.name, k)
    assert torch.equal(expanded(packed, tensor.tensor_type.name, 200, k, torch.float32), reference)


@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 12, 13, 64])
def test_gguf_linear_is_within_float32_error_of_float64(kind, dtype, rows):
    check_gguf_linear(kind, dtype, rows)


def test_a_quantized_linear_serves_ggufs_own_quantization_of_its_weight():
    """`quantize_weight` (the draft head's Q8_0 matmuls): the weight quantized by gguf, expanded
    bit-equal to gguf's dequantization of those blocks; a Linear serving it uses it."""
    from spectral.layers.linear import Linear, quantize_weight

    torch.manual_seed(3)
    w = torch.randn(40, 96)
    packed = quantize_weight(w, kernels, "Q8_0")
    qtype = gguf.GGMLQuantizationType.Q8_0
    reference = torch.from_numpy(
        gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
    )
    assert packed.gguf_type == "Q8_0"
    assert torch.equal(expanded(packed.data, "Q8_0", 40, 96, torch.float32), reference)
    assert quantize_weight(torch.randn(4, 33), kernels) is None  # not whole blocks
    layer = Linear(96, 40, bias=False)
    layer.weight.data.copy_(w)
    layer.set_kernels(kernels, quantize="Q8_0")
    x = torch.randn(3, 96)
    assert torch.allclose(layer(x), x @ reference.T, rtol=1e-5, atol=1e-5)


def block_offsets(blocks: torch.Tensor, kind: str, k: int) -> torch.Tensor:
    """|m| of every weight's block ([n, k]; Q4_0's m is -8d, Q8_0 has none)."""
    n, per_block = blocks.shape[0], blocks.shape[1] // (k // 32)
    raw = blocks.view(n, k // 32, per_block)
    if kind == "Q8_0":
        return torch.zeros(n, k)
    if kind == "Q4_1":
        m = raw[..., 2:4].contiguous().view(torch.float16).float().abs()
    else:
        m = 8 * raw[..., 0:2].contiguous().view(torch.float16).float().abs()
    return m.repeat_interleave(32, dim=1).view(n, k)


def check_gguf_matmul(x: torch.Tensor, blocks, reference, kind: str, n: int, build=kernels):
    """gguf_linear within float32's error of the float64 product with the expanded weights.
    One float32 row may sum d * sum(x q) + m * sum(x) per block, whose terms are bounded by
    |w| + 2|m|, not |w|: the bound uses that."""
    dtype, k = x.dtype, x.shape[1]
    w = reference.to(dtype)  # what the kernel multiplies by: bf16-rounded weights for bf16
    exact = x.double() @ w.double().T
    got = build.gguf_linear(x, build.pack_gguf_weight(blocks, kind, k), kind, n, None)
    assert got.dtype == dtype and got.shape == (x.shape[0], n)
    bound = float32_error_bound(x, w.abs() + 2 * block_offsets(blocks, kind, k).to(dtype))
    if dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2**-8
    assert ((got.double() - exact).abs() <= bound).all()


def check_gguf_linear(kind: str, dtype: torch.dtype, rows: int, build=kernels) -> None:
    n, k = 50, 160
    blocks, reference = gguf_blocks(n, k, kind, seed=rows)
    check_gguf_matmul(torch.randn(rows, k).to(dtype), blocks, reference, kind, n, build)


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 70),
    n=st.integers(1, 70),
    blocks=st.integers(1, 6),
    kind=st.sampled_from(GGUF_TYPES),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gguf_linear_holds_for_any_shape(m, n, blocks, kind, bf16, seed):
    k = 32 * blocks
    weights, reference = gguf_blocks(n, k, kind, seed)
    torch.manual_seed(seed)
    x = torch.randn(m, k).to(torch.bfloat16 if bf16 else torch.float32)
    check_gguf_matmul(x, weights, reference, kind, n)


def test_gguf_linear_refuses_what_it_does_not_implement_with_a_message():
    blocks, _ = gguf_blocks(4, 32, "Q8_0", seed=0)
    with pytest.raises(RuntimeError, match=r"Q5_K is not implemented \(Q4_0, Q4_1, Q8_0 are\)"):
        kernels.pack_gguf_weight(blocks, "Q5_K", 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_gguf_weight(blocks, "Q8_0", 33)


# The same sources built for narrower vector units than the CPU's: the scalar loops (what a CPU
# without AVX2 runs) always, the AVX2 path where the CPU has AVX-512.
NARROWER = {"scalar": 0, **({"avx2": 256} if "avx512f" in cpu_flags() else {})}


@pytest.mark.parametrize("isa", sorted(NARROWER))
def test_narrower_builds_hold_to_the_same_references(isa):
    build = load_cpu_kernels(isa)
    assert build is not None and build.vector_bits() == NARROWER[isa]
    for dtype in DTYPES:
        for rows in (1, 5, 13, 64):
            for n, k in ((33, 17), (70, 96)):
                check_packed_linear(rows, n, k, dtype, seed=rows + n, build=build)
            for kind in GGUF_TYPES:
                check_gguf_linear(kind, dtype, rows, build=build)
    for kind in GGUF_TYPES:
        check_gguf_expansion(kind, 33, 64, build=build)
    for dtype in DTYPES:
        check_prefill_rows(dtype, 64, build)
        check_silu_mul(dtype, build)
    check_argmax_rows(build)


class CountingLayer:
    """Stands in for a kernels.DecoderLayer and counts its calls."""

    def __init__(self, fused) -> None:
        self.fused, self.calls = fused, 0

    def forward(self, *args):
        self.calls += 1
        return self.fused.forward(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["decode", "tree", "prefill"])
def test_the_fused_decoder_layer_equals_the_layer_op_by_op(tiny_model_dir, dtype, shape):
    """Each layer as one kernel call (decode steps, tree verification, prefill chunks after a
    prefix) against the same layer run op by op through the same kernels and PyTorch glue;
    and it really ran. All layers in one call (DecoderStack) give exactly the per-layer
    calls' logits, final hidden states and captured layer inputs."""
    from spectral.worker.model_worker import ModelWorker

    worker = ModelWorker(
        tiny_model_dir,
        dtype=dtype,
        device="cpu",
        max_total_tokens=512,
        max_running_requests=4,
        max_context_len=128,
    )
    table, lens = worker.req_to_token, [7, 12, 30]
    rows = list(range(len(lens)))
    slots = iter(range(1, 512))
    for row, n in zip(rows, lens):
        table.write(row, 0, [next(slots) for _ in range(n + 4)])
        prefill = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.randint(3, 1000, (n,)),
            positions=torch.arange(n),
            out_cache_loc=table.table[row, :n].clone(),
            req_pool_indices=torch.tensor([row]),
            prefix_lens=[0],
            extend_lens=[n],
        )
        worker.forward_logits(prefill)
    if shape == "decode":
        new, custom = [1, 1, 1], None
        mode = ForwardMode.DECODE
    elif shape == "prefill":  # two requests' next chunks of 4 and 3 tokens
        rows, lens, new, custom = [0, 2], [7, 30], [4, 3], None
        mode = ForwardMode.EXTEND
    else:  # a 4-node tree (root, two children, a grandchild) on one request
        rows, lens, new = [2], [30], [4]
        custom = torch.tensor(
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
        ).flatten()
        mode = ForwardMode.TARGET_VERIFY
    loc = torch.cat([table.table[r, n : n + e] for r, n, e in zip(rows, lens, new)])

    def run(capture: tuple[int, ...] = ()) -> torch.Tensor:
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor([5, 9, 11, 13, 17, 19, 23][: sum(new)]),
            positions=torch.cat([torch.arange(n, n + e) for n, e in zip(lens, new)]),
            out_cache_loc=loc,
            req_pool_indices=torch.tensor(rows),
            prefix_lens=lens,
            extend_lens=new,
            custom_mask=custom,
            logits_rows="all" if shape != "decode" else "last",
        )
        if capture:  # the final hidden states and the captured layer inputs, stacked
            batch.capture_layers = capture
            hidden, captured = worker.forward_hidden(batch)
            return torch.stack([hidden, *captured])
        return worker.forward_logits(batch)

    # what an EAGLE-3 head reads: the first layer's input, a middle one's, the last's output
    capture = (0, len(worker.model.layers) // 2, len(worker.model.layers))

    assert worker.model.fused_stack is not None
    stacked, stacked_captured = run(), run(capture)
    worker.model.fused_stack = None
    layers = worker.model.layers
    counting = [CountingLayer(layer.fused) for layer in layers]
    for layer, c in zip(layers, counting):
        layer.fused = c
    fused = run()
    assert [c.calls for c in counting] == [1] * len(layers)
    assert torch.equal(stacked, fused)
    assert torch.equal(stacked_captured, run(capture))
    for layer in layers:
        layer.fused = None
    op_by_op = run()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(fused, op_by_op, rtol=tol, atol=tol * op_by_op.abs().max().item())
