"""FlashInfer's planning arrays, built on the CPU: equal to what the torch backend attends over,
and, read the way FlashInfer's documentation defines them, giving the torch backend's output."""

from __future__ import annotations

import random

import pytest
import torch

from spectral.forward import ForwardMode
from spectral.kernels.flashinfer_backend import FlashInferPlan, plan_arrays
from spectral.kernels.torch_backend import TorchAttentionBackend
from tests.attention_cases import CASES, SHAPES, AttentionCase, random_case

MORE_CASES = CASES + [
    (ForwardMode.DRAFT_EXTEND, [5, 0, 30], [2, 4, 1]),
    (ForwardMode.DRAFT_DECODE, [3, 20, 8], [4, 1, 7]),
    (ForwardMode.TARGET_VERIFY, [0, 1, 60, 7, 2], [10, 1, 16, 3, 2]),
]


def read_as_flashinfer(case: AttentionCase, plan: FlashInferPlan) -> torch.Tensor:
    """Attention by the documented meaning of the arrays (page size 1, NHD pages): request i's
    query rows qo_indptr[i]:qo_indptr[i+1] over the pages kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    (the last holding kv_last_page_len[i] tokens); under a custom mask, the flattened
    [qo_len, kv_len] block at mask_indptr[i]; else causal aligned to the end of the keys."""
    q, pool = case.q, case.pool
    heads, group = q.shape[1], q.shape[1] // pool.k[0].shape[1]
    out = torch.empty(q.shape[0], heads, q.shape[2])
    for i in range(len(plan.qo_indptr) - 1):
        q0, q1 = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        pages = plan.kv_indices[int(plan.kv_indptr[i]) : int(plan.kv_indptr[i + 1])].long()
        kv_len = len(pages) - 1 + int(plan.kv_last_page_len[i])
        keys, values = pool.k[0][pages][:kv_len], pool.v[0][pages][:kv_len]
        qo_len = q1 - q0
        if plan.custom_mask is not None:
            m0 = int(plan.mask_indptr[i])
            visible = plan.custom_mask[m0 : m0 + qo_len * kv_len].view(qo_len, kv_len)
        else:
            rows = torch.arange(qo_len)[:, None]
            visible = torch.arange(kv_len)[None, :] <= rows + kv_len - qo_len
        for h in range(heads):
            scores = q[q0:q1, h] @ keys[:, h // group].T * case.scaling
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out[q0:q1, h] = weights @ values[:, h // group]
    return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}h{s[1]}kv{s[2]}d")
def test_plans_equal_the_torch_backends_view_and_read_back_to_its_output(shape):
    rng = random.Random(7)
    for mode, prefixes, news in MORE_CASES:
        case = random_case(rng, mode, prefixes, news, *shape)
        backend = TorchAttentionBackend(case.pool, case.table, case.scaling, kernels=None)
        backend.init_forward_metadata(case.batch)
        expected = backend.forward(case.q, case.k, case.v, 0, case.batch)  # writes the new KV
        plan = plan_arrays(case.batch, case.table.table)

        for array in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len):
            assert array.dtype == torch.int32
        assert plan.kv_last_page_len.tolist() == [1] * len(news)
        requests = case.batch.attn_metadata.requests
        assert plan.qo_indptr.diff().tolist() == [r.num_new for r in requests]
        assert len(plan.kv_indices) == int(plan.kv_indptr[-1])
        assert (mode.uses_custom_mask()) == (plan.custom_mask is not None)
        for i, r in enumerate(requests):
            kv = plan.kv_indices[int(plan.kv_indptr[i]) : int(plan.kv_indptr[i + 1])]
            assert kv.tolist() == r.slots.tolist()
            if plan.custom_mask is not None:
                m0, m1 = int(plan.mask_indptr[i]), int(plan.mask_indptr[i + 1])
                assert m1 - m0 == r.num_new * len(r.slots)
                assert torch.equal(plan.custom_mask[m0:m1].view(r.num_new, -1), r.mask)
            elif r.mask is not None:  # a prefix under a causal block: FlashInfer's causal
                rows = torch.arange(r.num_new)[:, None]
                causal = torch.arange(len(r.slots))[None, :] <= rows + len(r.slots) - r.num_new
                assert torch.equal(causal, r.mask)
        got = read_as_flashinfer(case, plan)
        err = float((got - expected).abs().max())
        assert err < 1e-5, f"{mode.name} {prefixes}/{news}: max error {err:.2e}"


def test_the_default_backend_follows_the_device_dtype_and_flashinfers_presence(monkeypatch):
    import importlib.util

    from spectral.args import ServerArgs
    from spectral.kernels.base import default_attention_backend

    real_find_spec = importlib.util.find_spec

    def flashinfer_installed(present: bool) -> None:
        def find_spec(name, *args):
            if name == "flashinfer":
                return object() if present else None
            return real_find_spec(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    flashinfer_installed(True)
    assert default_attention_backend("cpu", torch.bfloat16) == "torch"
    assert default_attention_backend("cuda", torch.bfloat16) == "flashinfer"
    assert default_attention_backend("cuda:1", torch.float16) == "flashinfer"
    assert default_attention_backend("cuda", torch.float32) == "triton"  # not a FlashInfer type
    flashinfer_installed(False)
    assert default_attention_backend("cuda", torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ServerArgs(model_path="default", attention_backend="flash")
