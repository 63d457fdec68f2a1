"""spectral's fused Triton kernels (RMSNorm with the residual add, rotary in place on the fused
qkv and rotary with the KV writes, SiLU-and-mul) against the PyTorch code of spectral.layers,
under Triton's interpreter on CPU tensors (the GPU runs of the same kernels:
tests/gpu/test_fused_kernels.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (make test installs it)")

from tests.conftest import run_under_triton_interpreter  # noqa: E402
from tests.triton_fused_cases import DTYPES, HEAD_SHAPES, HIDDEN_SIZES, ROWS, report  # noqa: E402

NORM_CASES = len(DTYPES) * len(ROWS) * len(HIDDEN_SIZES) * 2
SILU_CASES = len(DTYPES) * len(ROWS) * len(HIDDEN_SIZES)
ROTARY_CASES = len(DTYPES) * len(ROWS) * len(HEAD_SHAPES)


def test_each_fused_kernel_matches_pytorch_in_every_dtype_and_shape():
    """float32, bfloat16 and float16; T = 1 and 17; H = 576 and 1536, with and without a
    residual; GQA head counts with positions out of order. Rotary bit for bit, the norm and
    SiLU within the ulps tests/triton_fused_cases.py states."""
    stdout = run_under_triton_interpreter("tests.triton_fused_cases")
    passed = [line.split()[0] for line in stdout.splitlines() if ": ok," in line]
    assert passed.count("add_rms_norm") == NORM_CASES
    assert passed.count("silu_and_mul") == SILU_CASES
    assert passed.count("rotary_inplace") == ROTARY_CASES
    assert passed.count("rotary_store") == ROTARY_CASES


def test_a_nan_is_never_within_tolerance():
    expected = torch.ones(4)
    got = expected.clone()
    got[2] = float("nan")
    assert not report("add_rms_norm nan case", got, expected)
    assert report("add_rms_norm equal case", expected.clone(), expected)
