"""On a CUDA GPU: the fused kernels of the Llama layers (RMSNorm with the residual add, rotary
on the fused qkv, SiLU-and-mul), spectral's Triton ones and FlashInfer's where installed,
each served through the layers (layers.cuda_fused) and compared with the layers' own PyTorch
code on the device; and their replay in a CUDA graph. Skipped where torch sees no GPU.

FlashInfer serves bfloat16 and float16 only, rounding once where PyTorch rounds after each
step: it is held to a few ulp (rotary: to the error of bfloat16 products); the Triton kernels
keep PyTorch's roundings."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from spectral.layers import cuda_fused
from spectral.layers.norm import RMSNorm
from spectral.layers.rotary import RotaryEmbedding
from spectral.models.llama import LlamaMLP

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none on this machine)"
)
# (provider, dtype): each provider in each dtype it serves
SERVED = [
    pytest.param("triton", torch.float32),
    pytest.param("triton", torch.bfloat16),
    pytest.param("flashinfer", torch.bfloat16),
]
# Largest difference from PyTorch in ulp, per (provider, dtype, kernel). Triton's float32 norm
# sums in another order; its float32 SiLU takes exp from ex2.approx (error growing with |x|).
MAX_ULPS = {
    ("triton", torch.float32): {"norm": 4, "rotary": 0, "silu": 16},
    ("triton", torch.bfloat16): {"norm": 2, "rotary": 0, "silu": 2},
    ("flashinfer", torch.bfloat16): {"norm": 4, "silu": 4},
}
HEAD_SHAPES = ((9, 3, 64), (4, 1, 128))  # (q heads, KV heads, head dim)
MAX_POSITIONS = 4096


class CountingModule:
    """Stands in for a module, recording the names read from it."""

    def __init__(self, module: ModuleType, reads: list[str]) -> None:
        self.module, self.reads = module, reads

    def __getattr__(self, name: str):
        self.reads.append(name)
        return getattr(self.module, name)


@contextlib.contextmanager
def served_by(provider: str | None) -> Iterator[list[str]]:
    """Within it, layers.cuda_fused finds only `provider` ("triton" or "flashinfer"; None:
    neither, and the layers run their PyTorch code); yields the names read from it."""
    reads: list[str] = []
    saved = cuda_fused.flashinfer_module, cuda_fused.triton_module
    found = {"flashinfer": saved[0], "triton": saved[1]}
    try:
        for name, find in found.items():
            module = find() if name == provider else None
            counted = None if module is None else CountingModule(module, reads)
            setattr(cuda_fused, f"{name}_module", lambda counted=counted: counted)
        yield reads
    finally:
        cuda_fused.flashinfer_module, cuda_fused.triton_module = saved


def ulps(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|got - expected| in units of the last place of expected (NaN where either is NaN)."""
    got, expected = got.cpu(), expected.cpu()
    magnitude = expected.abs()
    spacing = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude
    return (got.double() - expected.double()).abs() / spacing.double()


def assert_within_ulps(got: torch.Tensor, expected: torch.Tensor, limit: int, what: str) -> None:
    distance = ulps(got, expected)
    assert bool((distance <= limit).all()), f"{what}: {float(distance.max())} ulp (limit {limit})"


def random(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape)).to("cuda", dtype)


@pytest.mark.parametrize(("provider", "dtype"), SERVED, ids=str)
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("hidden", [576, 1536])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_pytorch(provider, dtype, rows, hidden, with_residual):
    torch.manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5).to("cuda")
    norm.weight.data = (1 + 0.5 * torch.randn(hidden)).to("cuda", dtype)
    x = random(rows, hidden, dtype=dtype, scale=2.0)
    residual = random(rows, hidden, dtype=dtype) if with_residual else None

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return norm(x.clone(), None if residual is None else residual.clone())

    with served_by(None):
        expected, expected_sum = run()
    with served_by(provider) as reads:
        normed, summed = run()
    assert reads, f"{provider} did not serve the norm"
    assert torch.equal(summed, expected_sum)
    limit = MAX_ULPS[provider, dtype]["norm"]
    assert_within_ulps(normed, expected, limit, f"{provider} norm")


def _rotary_inputs(shape: tuple[int, int, int], rows: int, dtype: torch.dtype):
    """RotaryEmbedding on the GPU for (heads, KV heads, head dim), a random fused qkv of
    `rows` and positions out of order."""
    heads, kv_heads, head_dim = shape
    torch.manual_seed(rows)
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    rotary = RotaryEmbedding(config, head_dim, MAX_POSITIONS).to("cuda")
    qkv = random(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    return rotary, qkv, torch.randperm(MAX_POSITIONS)[:rows].to("cuda")


@pytest.mark.parametrize(("provider", "dtype"), SERVED, ids=str)
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 17])
def test_rotary_matches_pytorch(provider, dtype, shape, rows):
    heads, kv_heads, head_dim = shape
    rotary, qkv, positions = _rotary_inputs(shape, rows, dtype)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def run(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split(sizes, dim=-1)
        q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
        q, k = rotary.rotate_qkv(q, k, qkv, positions, kernels=None)
        return torch.cat((q.flatten(1), k.flatten(1), v), dim=-1)

    with served_by(None):
        expected = run(qkv.clone())
    with served_by(provider) as reads:
        got = run(qkv.clone())
    assert reads, f"{provider} did not serve the rotary"
    v_start = sizes[0] + sizes[1]
    assert torch.equal(got[:, v_start:], qkv[:, v_start:])
    if provider == "triton":
        assert_within_ulps(got, expected, MAX_ULPS[provider, dtype]["rotary"], "triton rotary")
        return
    # FlashInfer rotates in float32 with unrounded tables: within bfloat16's error of the
    # products, x * cos + rotate_half(x) * sin, whose magnitude |x| + |rotate_half(x)| bounds
    x = qkv[:, :v_start].float().view(rows, -1, head_dim)
    bound = (x.abs() + x.roll(head_dim // 2, dims=-1).abs()).flatten(1) * 2.0**-6
    error = (got[:, :v_start].float() - expected[:, :v_start].float()).abs()
    assert bool((error <= bound).all()), f"flashinfer rotary: error {float(error.max())}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 17])
def test_rotation_with_the_kv_writes_matches_pytorch(dtype, shape, rows):
    """Triton's rotary_store (what a layer runs on a GPU): q as PyTorch rotates it, k rotated
    and v written to the pools at the rows' slots, bit for bit."""
    heads, kv_heads, head_dim = shape
    rotary, qkv, positions = _rotary_inputs(shape, rows, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    with served_by(None):
        expected_q, expected_k = rotary.rotate_qkv(q, k, qkv.clone(), positions, kernels=None)
    loc = torch.randperm(3 * rows, device="cuda")[:rows]
    pools = [torch.zeros(3 * rows, kv_heads, head_dim, dtype=dtype, device="cuda") for _ in "kv"]
    with served_by("triton") as reads:
        got = rotary.rotate_and_store(qkv, (heads, kv_heads, head_dim), positions, (*pools, loc))
    assert reads and got is not None, "triton did not serve the rotation with the KV writes"
    assert torch.equal(got, expected_q.contiguous())
    assert torch.equal(pools[0][loc], expected_k) and torch.equal(pools[1][loc], v.view_as(k))


@pytest.mark.parametrize(("provider", "dtype"), SERVED, ids=str)
@pytest.mark.parametrize("rows", [1, 17])
def test_silu_and_mul_matches_pytorch(provider, dtype, rows):
    torch.manual_seed(rows)
    gate_up = random(rows, 2 * 1536, dtype=dtype, scale=3.0)
    gate, up = gate_up.split(1536, dim=-1)
    with served_by(provider) as reads:
        got = cuda_fused.silu_and_mul(gate_up)
    assert reads and got is not None, f"{provider} did not serve silu_and_mul"
    limit = MAX_ULPS[provider, dtype]["silu"]
    assert_within_ulps(got, F.silu(gate) * up, limit, f"{provider} silu_and_mul")


@pytest.mark.parametrize(("provider", "dtype"), SERVED, ids=str)
def test_llama_mlp_runs_through_the_fused_silu(provider, dtype):
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=576, intermediate_size=1536, mlp_bias=False)
    mlp = LlamaMLP(config).to("cuda", dtype)
    x = random(5, 576, dtype=dtype)
    with served_by(None):
        expected = mlp(x)
    with served_by(provider) as reads:
        got = mlp(x)
    assert reads, f"{provider} did not serve the MLP's silu_and_mul"
    scale = float(expected.abs().max())
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-6
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * scale)


def test_float32_is_never_given_to_flashinfer():
    x = random(3, 576, dtype=torch.float32)
    weight = torch.ones(576, device="cuda")
    with served_by("flashinfer") as reads:
        assert cuda_fused.add_rms_norm(x, None, weight, 1e-5) is None
        assert cuda_fused.silu_and_mul(random(3, 64, dtype=torch.float32)) is None
    assert not reads


@pytest.mark.parametrize(("provider", "dtype"), SERVED, ids=str)
def test_the_fused_layers_replay_in_a_cuda_graph(provider, dtype):
    """Norm, rotary and SiLU-and-mul captured once replay on new inputs as they run eagerly."""
    torch.manual_seed(1)
    rows, heads, kv_heads, head_dim = 4, 9, 3, 64
    norm = RMSNorm(576, 1e-5).to("cuda", dtype)
    config = LlamaConfig(
        hidden_size=576, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64
    )
    rotary = RotaryEmbedding(config, head_dim, MAX_POSITIONS).to("cuda")
    width = (heads + 2 * kv_heads) * head_dim
    inputs = {
        "x": random(rows, 576, dtype=dtype),
        "residual": random(rows, 576, dtype=dtype),
        "qkv": random(rows, width, dtype=dtype),
        "positions": torch.zeros(rows, dtype=torch.int64, device="cuda"),
        "gate_up": random(rows, 2 * 1536, dtype=dtype),
    }

    def step(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        normed, summed = norm(t["x"], t["residual"])
        qkv = t["qkv"]
        q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, -1)
        rotary.rotate_qkv(q, k, qkv, t["positions"], kernels=None)
        return [normed, summed, qkv, cuda_fused.silu_and_mul(t["gate_up"])]

    with served_by(provider):
        static = {name: value.clone() for name, value in inputs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step({name: value.clone() for name, value in inputs.items()})  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step(static)
        fresh = {"positions": torch.randperm(MAX_POSITIONS)[:rows].to("cuda")}
        for name in ("x", "residual", "qkv", "gate_up"):
            fresh[name] = random(*inputs[name].shape, dtype=dtype)
        for name, value in fresh.items():
            static[name].copy_(value)
        graph.replay()
        expected = step({name: value.clone() for name, value in fresh.items()})
    for got, want in zip(outputs, expected):
        assert torch.equal(got, want)
