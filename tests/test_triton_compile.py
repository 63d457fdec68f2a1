"""spectral's Triton kernels compile for the GPUs they are meant for, here on a CPU.

Triton's interpreter (tests/test_triton_attention.py) runs a kernel's Python without compiling
it, so it accepts what the compiler refuses (a kernel reading a module global that is not a
`tl.constexpr`, say). Each launch the Triton backend makes, in every mode and dtype, and each
of the fused layer kernels (kernels.triton.fused), is captured on CPU tensors and compiled to a
cubin for Hopper (sm_90), the GPU spectral is checked on: Triton's front end and its bundled
ptxas need no GPU."""

from __future__ import annotations

import os
import random

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (make test installs it)")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip(
        "Triton's interpreter is on in this process: nothing compiles", allow_module_level=True
    )

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from spectral.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from spectral.kernels.triton import attention, extend, fused  # noqa: E402
from tests.attention_cases import CASES, random_case  # noqa: E402

POINTEE = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}
# Keyword arguments of a launch that are options of the compiler, not constexprs of the kernel.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def source(kernel, args: tuple, kwargs: dict) -> ASTSource:
    """The launch as Triton's compiler sees it: each runtime argument typed from its value,
    the keyword (constexpr) ones as constants."""
    names = kernel.arg_names
    kwargs = {n: v for n, v in kwargs.items() if n not in LAUNCH_OPTIONS}
    bound = dict(zip(names, args)) | kwargs
    constexprs = {(names.index(n),): kwargs[n] for n in kwargs}
    signature = {n: "constexpr" if n in kwargs else arg_type(bound[n]) for n in names}
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs)


def compile_each(recorded: list) -> set[tuple]:
    """Compiles each distinct launch of `recorded` to a cubin for sm_90 (with its launch
    options); the keys (kernel name, argument types, keyword arguments) of those compiled."""
    seen: set[tuple] = set()
    for kernel, args, kwargs in recorded:
        src = source(kernel, args, kwargs)
        key = (kernel.fn.__name__, tuple(src.signature.values()), tuple(sorted(kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        options = {n: v for n, v in kwargs.items() if n in LAUNCH_OPTIONS}
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert out.asm["cubin"], f"{key[0]} gave no cubin for sm_90"
    return seen


def launches(dtype: torch.dtype, monkeypatch) -> list:
    """Every launch the Triton backend makes over the attention cases in `dtype` (GQA, head
    dim 64), on CPU tensors, without running a kernel."""
    recorded: list = []
    monkeypatch.setattr(
        attention, "_row_attention_kernel", Recorder(attention._row_attention_kernel, recorded)
    )
    monkeypatch.setattr(extend, "_extend_kernel", Recorder(extend._extend_kernel, recorded))
    import spectral.attention.triton_backend as backend_module

    monkeypatch.setattr(backend_module, "row_attention", attention.row_attention)
    monkeypatch.setattr(backend_module, "extend_attention", extend.extend_attention)
    rng = random.Random(0)
    for mode, prefixes, news in CASES:
        case = random_case(rng, mode, prefixes, news, 8, 2, 64).to("cpu", dtype)
        backend = TritonAttentionBackend(case.pool, case.table, case.scaling)
        backend.init_forward_metadata(case.batch)
        backend.forward(case.q, case.k, case.v, 0, case.batch)
    # a draft tree level's rows: each over its table row, then its ancestors' slots
    k_pool = v_pool = torch.zeros(40, 2, 64, dtype=dtype)
    rows, tail = torch.zeros(6, dtype=torch.int64), torch.ones((6, 3), dtype=torch.int64)
    table = torch.ones((2, 16), dtype=torch.int64)
    q = torch.zeros(6, 8, 64, dtype=dtype)
    attention.row_attention(q, k_pool, v_pool, table, rows + 4, 1.0, rows, tail)
    return recorded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_triton_launch_compiles_for_hopper(dtype, monkeypatch):
    """Decode rows (with and without a draft level's tail), causal extend and tree
    verification (custom mask): each distinct launch compiles to a cubin for sm_90."""
    seen = compile_each(launches(dtype, monkeypatch))
    assert {k[0] for k in seen} == {"_row_attention_kernel", "_extend_kernel"}
    tails = {dict(k[2])["TAIL"] for k in seen if k[0] == "_row_attention_kernel"}
    assert tails == {0, 3}, "the row kernel compiled without and with a tail"
    masked = {k[2] for k in seen if k[0] == "_extend_kernel"}
    assert len(masked) == 2, "the extend kernel compiled with and without the tree mask"


FUSED_KERNELS = (
    "_add_rms_norm_kernel",
    "_rotary_kernel",
    "_silu_and_mul_kernel",
)


def fused_launches(dtype: torch.dtype, monkeypatch) -> list:
    """The fused layer kernels' launches in `dtype` for SmolLM2-135M's shapes (hidden 576, 9/3
    heads of 64, intermediate 1536) and a wider hidden size (more warps), on CPU tensors,
    without running a kernel."""
    recorded: list = []
    for name in FUSED_KERNELS:
        monkeypatch.setattr(fused, name, Recorder(getattr(fused, name), recorded))
    for hidden in (576, 4096):
        x, residual = torch.zeros(3, hidden, dtype=dtype), torch.zeros(3, hidden, dtype=dtype)
        weight = torch.ones(hidden, dtype=dtype)
        fused.add_rms_norm(x, None, weight, 1e-5)
        fused.add_rms_norm(x, residual, weight, 1e-5)
    cos = sin = torch.zeros(128, 64)
    qkv = torch.zeros(3, (9 + 2 * 3) * 64, dtype=dtype)
    positions = torch.zeros(3, dtype=torch.int64)
    fused.rotary_inplace(qkv, 9 + 3, 64, cos, sin, positions)
    pool = torch.zeros(8, 3, 64, dtype=dtype)
    fused.rotary_store(qkv, 9, 3, 64, cos, sin, positions, pool, pool.clone(), positions)
    fused.silu_and_mul(torch.zeros(3, 2 * 1536, dtype=dtype))
    return recorded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_fused_kernel_launch_compiles_for_hopper(dtype, monkeypatch):
    """RMSNorm with and without the residual, rotary on the fused qkv and SiLU-and-mul: each
    distinct launch compiles to a cubin for sm_90."""
    seen = compile_each(fused_launches(dtype, monkeypatch))
    kernels = [k[0] for k in seen]
    assert set(kernels) == set(FUSED_KERNELS)
    assert kernels.count("_add_rms_norm_kernel") == 4, "with and without a residual, two sizes"
    assert kernels.count("_rotary_kernel") == 2, "in place and storing K and V"
