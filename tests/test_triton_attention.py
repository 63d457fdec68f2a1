"""spectral's Triton attention kernel and backend against the torch backend, under Triton's
interpreter on CPU tensors (the GPU runs of the same kernel: tests/gpu, where a GPU is present)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (make test installs it)")

from tests.conftest import run_under_triton_interpreter  # noqa: E402


def test_the_triton_backend_equals_the_torch_backend_in_every_mode():
    """The backend's kernels (`row_attention` for decode, the tiled `extend_attention` for
    prefill with and without a cached prefix, several tiles long, and draft-tree
    verification), decode rows with a tail of their own slots (a draft tree's levels); ragged
    batches, GQA and MHA; float32 within 1e-5, each case on its own (a NaN fails). An Engine
    with the backend gives the torch backend's greedy tokens, plainly and with EAGLE3
    (tests/triton_cases.py)."""
    stdout = run_under_triton_interpreter("tests.triton_cases")
    assert stdout.count("max error") == 13 and stdout.count("engine,") == 3
