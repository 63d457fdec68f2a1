"""Cases for spectral's fused Triton kernels (kernels.triton.fused) against the PyTorch code of
spectral.layers, run by tests/test_triton_fused.py in a process of their own: Triton's
interpreter must be chosen (TRITON_INTERPRET=1) before triton is imported.

The interpreter truncates float32 to bfloat16 where a GPU rounds to nearest even; the cases
give it the GPU's rounding first, so bfloat16 results can be compared to the last bit. Each
case prints one line, "<case>: ok, ..." when the kernel is within its tolerance in units in
the last place (ulp) of the reference; a NaN is never within it."""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F
import triton.language as tl
from transformers import LlamaConfig

from spectral.kernels.triton import fused
from spectral.layers.norm import RMSNorm
from spectral.layers.rotary import RotaryEmbedding

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS = (1, 17)
HIDDEN_SIZES = (576, 1536)
HEAD_SHAPES = ((9, 3, 64), (4, 1, 128), (6, 2, 96))  # (q heads, KV heads, head dim)
MAX_POSITIONS = 4096
# Tolerances in ulp of PyTorch's result, (float32, half precision). Rotary keeps PyTorch's
# roundings and reads the same tables: exact. The norm's float32 sum and rsqrt, and SiLU's exp
# (numpy's here, the GPU's ex2.approx there, Sleef's in PyTorch; each ~2 ulp from the true
# value), differ from PyTorch's in the last bits; in half precision that can move the rounding
# of a factor by one ulp, and so the product by up to two.
MAX_ULPS = {
    "add_rms_norm": (4, 2),
    "rotary_inplace": (0, 0),
    "rotary_store": (0, 0),
    "silu_and_mul": (4, 2),
}


def round_bfloat16_to_nearest_even() -> None:
    """The interpreter's float32 -> bfloat16 conversion rounds to nearest even, as the GPU's
    does (the interpreter's own drops the low bits)."""
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def rounded(data, src_type, dst_type, rounding_mode):
        if src_type == tl.float32 and dst_type == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return convert(data, src_type, dst_type, rounding_mode)

    interpreter._convert_float = rounded


def ulps(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|got - expected| in units of the last place of expected, in float64 (NaN where either
    is NaN)."""
    magnitude = expected.abs()
    spacing = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude
    return (got.double() - expected.double()).abs() / spacing.double()


def report(name: str, got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Prints the case's line; True where every element is within the kernel's tolerance."""
    distance = ulps(got, expected)
    limit = MAX_ULPS[name.split()[0]][got.dtype != torch.float32]
    within = bool((distance <= limit).all())
    worst = float(distance.max()) if distance.numel() else 0.0
    differ = int((distance != 0).sum())
    abs_error = float((got.double() - expected.double()).abs().max())
    print(
        f"{name}: {'ok' if within else 'FAILED'}, max {worst:g} ulp, {differ} of "
        f"{got.numel()} differ, max abs error {abs_error:.2e}"
    )
    return within


def add_rms_norm_case(dtype: torch.dtype, rows: int, hidden: int, with_residual: bool) -> bool:
    """The kernel against RMSNorm's PyTorch path: normed within 1 ulp, summed exact and
    written into the residual (or x itself, unchanged, without one)."""
    name = f"add_rms_norm {str(dtype)[6:]} T={rows} H={hidden} residual={with_residual}"
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (1 + 0.5 * torch.randn(hidden)).to(dtype)
    x = (2 * torch.randn(rows, hidden)).to(dtype)
    residual = torch.randn(rows, hidden).to(dtype) if with_residual else None
    expected, expected_sum = norm(x, residual)
    x_before = x.clone()
    given = None if residual is None else residual.clone()
    normed, summed = fused.add_rms_norm(x, given, norm.weight, norm.eps)
    kept = summed is given if with_residual else summed is x and torch.equal(x, x_before)
    if not (kept and torch.equal(summed, expected_sum)):
        print(f"{name}: FAILED, the sum differs or was not written in place")
        return False
    return report(name, normed, expected)


def _rotary_inputs(dtype: torch.dtype, rows: int, heads: int, kv_heads: int, head_dim: int):
    """A fused qkv, positions out of order (with a repeat), the rotary tables, and PyTorch's
    rotated q [T, H, D], rotated k and v [T, KVH, D]."""
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
    )
    rotary = RotaryEmbedding(config, head_dim, MAX_POSITIONS)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randperm(MAX_POSITIONS)[:rows]
    positions[-1] = positions[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(rows, heads, head_dim)
    k = k.view(rows, kv_heads, head_dim)
    expected_q, expected_k = rotary.rotate_qkv(q, k, qkv.clone(), positions, kernels=None)
    return qkv, positions, rotary, expected_q, expected_k, v.reshape(rows, kv_heads, head_dim)


def rotary_case(dtype: torch.dtype, rows: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """The kernel on a fused qkv against RotaryEmbedding's PyTorch path; v untouched."""
    name = f"rotary_inplace {str(dtype)[6:]} T={rows} heads {heads}/{kv_heads} dim {head_dim}"
    qkv, positions, rotary, q, k, v = _rotary_inputs(dtype, rows, heads, kv_heads, head_dim)
    expected = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)
    got = qkv.clone()
    fused.rotary_inplace(got, heads + kv_heads, head_dim, rotary.cos, rotary.sin, positions)
    return report(name, got, expected)


def rotary_store_case(
    dtype: torch.dtype, rows: int, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """The rotation with the KV writes: q as PyTorch rotates it, k rotated and v in the pools
    at the rows' slots (out of order) and nowhere else, qkv left as it was."""
    name = f"rotary_store {str(dtype)[6:]} T={rows} heads {heads}/{kv_heads} dim {head_dim}"
    qkv, positions, rotary, q, k, v = _rotary_inputs(dtype, rows, heads, kv_heads, head_dim)
    slots = 3 * rows + 5
    loc = torch.randperm(slots)[:rows]
    k_pool, v_pool = (torch.full((slots, kv_heads, head_dim), 7.0, dtype=dtype) for _ in "kv")
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    expected_k[loc], expected_v[loc] = k, v
    before = qkv.clone()
    args = (rotary.cos, rotary.sin, positions, k_pool, v_pool, loc)
    got_q = fused.rotary_store(qkv, heads, kv_heads, head_dim, *args)
    if not torch.equal(qkv, before) or not got_q.is_contiguous():
        print(f"{name}: FAILED, qkv was written or q is not contiguous")
        return False
    got = torch.cat((got_q.flatten(), k_pool.flatten(), v_pool.flatten()))
    return report(name, got, torch.cat((q.flatten(), expected_k.flatten(), expected_v.flatten())))


def silu_and_mul_case(dtype: torch.dtype, rows: int, intermediate: int) -> bool:
    """The kernel against `F.silu(gate) * up`, as LlamaMLP computes it."""
    name = f"silu_and_mul {str(dtype)[6:]} T={rows} I={intermediate}"
    gate_up = (3 * torch.randn(rows, 2 * intermediate)).to(dtype)
    gate, up = gate_up.split(intermediate, dim=-1)
    return report(name, fused.silu_and_mul(gate_up), F.silu(gate) * up)


def main() -> int:
    round_bfloat16_to_nearest_even()
    torch.manual_seed(0)
    results = []
    for dtype in DTYPES:
        for rows in ROWS:
            for hidden in HIDDEN_SIZES:
                for with_residual in (False, True):
                    results.append(add_rms_norm_case(dtype, rows, hidden, with_residual))
                results.append(silu_and_mul_case(dtype, rows, hidden))
            for heads, kv_heads, head_dim in HEAD_SHAPES:
                results.append(rotary_case(dtype, rows, heads, kv_heads, head_dim))
                results.append(rotary_store_case(dtype, rows, heads, kv_heads, head_dim))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
