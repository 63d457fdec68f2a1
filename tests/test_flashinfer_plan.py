"""The FlashInfer backend on the CPU: its planning arrays equal what the torch backend attends
over and, read the way FlashInfer's documentation defines them, give the torch backend's
output; the backend drives stand-ins of FlashInfer's wrappers (their documented signatures,
computing on the CPU) to the torch backend's output in every mode. FlashInfer's own kernels
run in tests/gpu."""

from __future__ import annotations

import random

import pytest
import torch

from spectral.attention.flashinfer_backend import FlashInferPlan, plan_arrays
from spectral.attention.torch_backend import TorchAttentionBackend
from spectral.core.forward import ForwardMode
from tests.attention_cases import CASES, SHAPES, AttentionCase, random_case

MORE_CASES = CASES + [
    (ForwardMode.DRAFT_EXTEND, [5, 0, 30], [2, 4, 1]),
    (ForwardMode.DRAFT_DECODE, [3, 20, 8], [4, 1, 7]),
    (ForwardMode.TARGET_VERIFY, [0, 1, 60, 7, 2], [10, 1, 16, 3, 2]),
]


def paged_attention(
    q: torch.Tensor,
    pages: tuple[torch.Tensor, torch.Tensor],
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    sm_scale: float,
    custom_mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention as FlashInfer's documentation defines its arrays, in float32: request i's query
    rows qo_indptr[i]:qo_indptr[i+1] over the pages kv_indices[kv_indptr[i]:kv_indptr[i+1]] of
    the NHD cache ([pages, page_size, KV heads, dim]; the last page holding
    kv_last_page_len[i] tokens); under a custom mask, request i's flattened [qo_len, kv_len]
    block, the blocks laid end to end; else causal aligned to the end of the keys, or none."""
    k_cache, v_cache = pages
    page_size = k_cache.shape[1]
    heads, group = q.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    mask_start = 0
    for i in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        used = kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])].long()
        kv_len = (len(used) - 1) * page_size + int(kv_last_page_len[i])
        keys = k_cache[used].flatten(0, 1)[:kv_len].float()
        values = v_cache[used].flatten(0, 1)[:kv_len].float()
        qo_len = q1 - q0
        rows = torch.arange(qo_len)[:, None]
        if custom_mask is not None:
            visible = custom_mask[mask_start : mask_start + qo_len * kv_len].view(qo_len, kv_len)
            mask_start += qo_len * kv_len
        elif causal:
            visible = torch.arange(kv_len)[None, :] <= rows + kv_len - qo_len
        else:
            visible = torch.ones((qo_len, kv_len), dtype=torch.bool)
        for h in range(heads):
            scores = q[q0:q1, h].float() @ keys[:, h // group].T * sm_scale
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out[q0:q1, h] = weights @ values[:, h // group]
    return out


def read_as_flashinfer(case: AttentionCase, plan: FlashInferPlan) -> torch.Tensor:
    """The plan applied to the case's pool as pages of one token."""
    pages = (case.pool.k[0].unsqueeze(1), case.pool.v[0].unsqueeze(1))
    out = paged_attention(
        case.q,
        pages,
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.kv_last_page_len,
        case.scaling,
        plan.custom_mask,
        causal=True,
    )
    return out.reshape(case.q.shape[0], -1)


class StandInWrappers:
    """flashinfer's two wrappers with their documented signatures, computing by
    `paged_attention` on the CPU; each records what it was planned with."""

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", backend="auto"):
            assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
            assert backend in ("auto", "fa2", "fa3", "trtllm-gen", "cudnn")
            self.planned = None

        def plan(
            self,
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            head_dim_vo=None,
            custom_mask=None,
            packed_custom_mask=None,
            causal=False,
            sm_scale=None,
            q_data_type="float16",
            kv_data_type=None,
        ):
            self.planned = dict(
                arrays=(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len),
                heads=(num_qo_heads, num_kv_heads, head_dim_qk, page_size),
                custom_mask=custom_mask,
                causal=causal,
                sm_scale=sm_scale,
                dtypes=(q_data_type, kv_data_type),
            )

        def run(self, q, paged_kv_cache):
            p = self.planned
            assert q.dtype == p["dtypes"][0] and paged_kv_cache[0].dtype == p["dtypes"][1]
            assert q.shape[1:] == (p["heads"][0], p["heads"][2])
            assert paged_kv_cache[0].shape[1:] == (p["heads"][3], p["heads"][1], p["heads"][2])
            out = paged_attention(
                q, paged_kv_cache, *p["arrays"], p["sm_scale"], p["custom_mask"], p["causal"]
            )
            return out.to(q.dtype)

    class BatchDecodeWithPagedKVCacheWrapper(BatchPrefillWithPagedKVCacheWrapper):
        """In CUDA-graph mode (`use_cuda_graph`) the batch size is fixed by the indptr buffer,
        `plan` copies the arrays into the given buffers and `run` reads them from there."""

        def __init__(
            self,
            float_workspace_buffer,
            kv_layout="NHD",
            use_cuda_graph=False,
            use_tensor_cores=False,
            paged_kv_indptr_buffer=None,
            paged_kv_indices_buffer=None,
            paged_kv_last_page_len_buffer=None,
        ):
            super().__init__(float_workspace_buffer, kv_layout)
            self.buffers = None
            if use_cuda_graph:
                self.buffers = (
                    paged_kv_indptr_buffer,
                    paged_kv_indices_buffer,
                    paged_kv_last_page_len_buffer,
                )
                assert all(b is not None and b.dtype == torch.int32 for b in self.buffers)

        def plan(
            self,
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            *,
            q_data_type="float16",
            kv_data_type=None,
            sm_scale=None,
            non_blocking=False,
        ):
            rows = torch.arange(len(indptr), dtype=torch.int32)  # one query per request
            if self.buffers is not None:
                indptr_buf, indices_buf, last_buf = self.buffers
                assert len(indptr) == len(indptr_buf), "the batch size is fixed in graph mode"
                indptr_buf.copy_(indptr)
                indices_buf[: len(indices)].copy_(indices)
                last_buf.copy_(last_page_len)
                indptr, indices, last_page_len = indptr_buf, indices_buf, last_buf
            super().plan(
                rows,
                indptr,
                indices,
                last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                sm_scale=sm_scale,
                q_data_type=q_data_type,
                kv_data_type=kv_data_type,
            )


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


def test_a_small_trees_plan_is_the_one_written_out_by_hand():
    """Two requests verifying trees: request 0 (row 0: slots 11-14) has 2 tokens cached and
    a root with one child; request 1 (row 1: slots 21-23) 1 token cached and a root with a
    sibling beside it. Every array of the plan, by hand (not through the backends' helpers)."""
    from spectral.core.forward import ForwardBatch
    from spectral.mem.req_to_token import ReqToTokenPool

    table = ReqToTokenPool(2, 8)
    table.write(0, 0, [11, 12, 13, 14])
    table.write(1, 0, [21, 22, 23])
    batch = ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=torch.tensor([5, 6, 7, 8]),
        positions=torch.tensor([2, 3, 1, 1]),
        out_cache_loc=torch.tensor([13, 14, 22, 23]),
        req_pool_indices=torch.tensor([0, 1]),
        prefix_lens=[2, 1],
        extend_lens=[2, 2],
        custom_mask=torch.tensor([1, 0, 1, 1, 1, 0, 0, 1], dtype=torch.bool),
    )
    plan = plan_arrays(batch, table.table)
    assert plan.qo_indptr.tolist() == [0, 2, 4]
    assert plan.kv_indptr.tolist() == [0, 4, 7]
    assert plan.kv_indices.tolist() == [11, 12, 13, 14, 21, 22, 23]
    assert plan.kv_last_page_len.tolist() == [1, 1]
    assert plan.mask_indptr.tolist() == [0, 8, 14]
    # per request, [new tokens x its keys]: the prefix always, then the tree's own mask
    request0 = [1, 1, 1, 0] + [1, 1, 1, 1]
    request1 = [1, 1, 0] + [1, 0, 1]
    assert plan.custom_mask.int().tolist() == request0 + request1


def test_the_default_backend_follows_the_device_dtype_and_flashinfers_presence(monkeypatch):
    import importlib.util

    from spectral.args import ServerArgs
    from spectral.attention.registry import default_attention_backend

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


class TreeStandIn(TorchAttentionBackend):
    """The flashinfer backend's tree-verification backend (it attends once the keys and
    values are in the pool), counting the layers it ran."""

    calls = 0

    def attend(self, q, layer_id, batch):
        self.calls += 1
        loc = batch.out_cache_loc
        k, v = self.kv_pool.k[layer_id][loc], self.kv_pool.v[layer_id][loc]
        return self.forward(q, k, v, layer_id, batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_backend_drives_flashinfers_wrappers_as_documented(monkeypatch, dtype):
    """FlashInferAttentionBackend against flashinfer's wrappers as documented (a stand-in with
    their signatures, computing on the CPU), every mode (tree verification through the Triton
    backend instead, which static buffers can replay): the torch backend's output in float32
    within the dtype's rounding; a float32 pool is refused with what to use instead."""
    import sys

    from spectral.attention.flashinfer_backend import FlashInferAttentionBackend

    monkeypatch.setitem(sys.modules, "flashinfer", StandInWrappers)
    rng = random.Random(5)
    for mode, prefixes, news in MORE_CASES:
        case = random_case(rng, mode, prefixes, news, 4, 2, 16)
        oracle = TorchAttentionBackend(case.pool, case.table, case.scaling, kernels=None)
        oracle.init_forward_metadata(case.batch)
        expected = oracle.forward(case.q, case.k, case.v, 0, case.batch)
        low = case.to("cpu", dtype)
        backend = FlashInferAttentionBackend(low.pool, low.table, low.scaling)
        # tree verification goes to the Triton backend (tested against the torch backend in
        # tests/triton_cases.py; here a torch backend stands in for it, as Triton needs a GPU
        # or its interpreter)
        tree = TreeStandIn(low.pool, low.table, low.scaling, kernels=None)
        backend.tree = tree
        backend.init_forward_metadata(low.batch)
        got = backend.forward(low.q, low.k, low.v, 0, low.batch).float()
        if mode == ForwardMode.TARGET_VERIFY:
            assert tree.calls == 1 and backend.prefill.planned is None, mode
        else:
            wrapper = backend.decode if mode.is_decode() else backend.prefill
            assert wrapper.planned is not None and tree.calls == 0, mode
        err = float((got - expected).abs().max())
        assert err < 3e-2, f"{mode.name} {dtype}: max error {err:.2e}"
    with pytest.raises(ValueError, match="use --attention-backend triton for float32"):
        FlashInferAttentionBackend(case.pool, case.table, case.scaling)


def test_static_decode_batches_plan_flashinfers_graph_wrappers(monkeypatch):
    """A decode step in static buffers (the graph runner's, padded with the dummy row): the
    backend plans a CUDA-graph-mode wrapper of the bucket's size before the replay, whose
    buffers give the torch backend's output on the real rows."""
    import sys

    from spectral.attention.flashinfer_backend import FlashInferAttentionBackend
    from spectral.worker.graph_runner import Bucket, StaticInputs

    monkeypatch.setitem(sys.modules, "flashinfer", StandInWrappers)
    case = random_case(random.Random(11), ForwardMode.DECODE, [7, 70, 1], [1, 1, 1], 4, 2, 16)
    oracle = TorchAttentionBackend(case.pool, case.table, case.scaling, kernels=None)
    oracle.init_forward_metadata(case.batch)
    expected = oracle.forward(case.q, case.k, case.v, 0, case.batch)
    low = case.to("cpu", torch.bfloat16)
    backend = FlashInferAttentionBackend(low.pool, low.table, low.scaling, num_heads=4)
    inputs = StaticInputs(max_tokens=4, max_requests=4, max_mask=0, device="cpu")
    static = inputs.batch(Bucket(tokens=1, requests=4), capture_layers=())
    b = low.batch
    static.out_cache_loc[:3].copy_(b.out_cache_loc)
    static.req_pool_indices.copy_(torch.tensor([*b.req_pool_indices.tolist(), low.table.dummy_row]))
    static.seq_lens_tensor.copy_(torch.tensor([8, 71, 2, 1]))
    static.prefix_lens = [7, 70, 1, 0]
    backend.prepare_replay(static)
    backend.init_forward_metadata(static)
    padded = [torch.cat((t, t[:1])) for t in (low.q, low.k, low.v)]
    got = backend.forward(*padded, 0, static).float()[:3]
    wrapper = backend._graph_wrappers[4]
    assert wrapper.buffers is not None and int(wrapper.buffers[0][-1]) == 8 + 71 + 2 + 1
    assert float((got - expected).abs().max()) < 3e-2
