"""An EAGLE round's draft levels without host reads, and through static buffers (issue 53).

The draft's tree levels attend through `attention.rows` (each node over its request's table row
and its ancestors' scratch slots): checked against a naive softmax per row, and the whole
expansion against a dense reference written here (the prefix gathered, the tree's keys kept
per level, an ancestor mask: how a draft was computed before). The static path (`DraftGraphs`,
CUDA graphs on a GPU, run eagerly here) gives the eager expansion's candidates at every batch
size it pads to, and an engine drafting through it gives plain decoding's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from spectral.attention.registry import create_attention_backend
from spectral.attention.rows import explicit_rows, rows_attention
from spectral.core.req import Req
from spectral.kernels.cpu_kernels import load_cpu_kernels
from spectral.sampling_params import SamplingParams
from spectral.speculative.drafters.expansion import TreeExpansion
from spectral.speculative.drafters.head_batches import round_draft_batch
from tests.test_speculative import eagle3_head, make_spec_scheduler, prompts  # noqa: F401


def naive_rows_attention(q, k_pool, v_pool, table, rows, seq_lens, tail, scaling):
    """Row by row in float64: the row's table prefix, then its tail slots."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[1]
    for t in range(q.shape[0]):
        slots = table[rows[t], : seq_lens[t]].tolist() + tail[t].tolist()
        keys = k_pool[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_pool[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), keys) * scaling
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values).to(q.dtype)
    return out


@pytest.mark.parametrize("with_kernels", [False, True])
def test_rows_with_a_tail_attend_to_their_prefix_and_tail(with_kernels):
    kernels = load_cpu_kernels() if with_kernels else None
    if with_kernels and kernels is None:
        pytest.skip("no C++ compiler here (make test builds the kernels)")
    torch.manual_seed(0)
    slots, heads, kv_heads, dim = 64, 4, 2, 16
    k_pool, v_pool = torch.randn(2, slots, kv_heads, dim).unbind(0)
    table = torch.randint(1, slots, (5, 12))
    rows = torch.tensor([0, 0, 3, 4, 2])
    seq_lens = torch.tensor([1, 7, 12, 3, 5])
    tail = torch.randint(1, slots, (5, 3))
    q = torch.randn(5, heads, dim)
    got = rows_attention(q, k_pool, v_pool, table, rows, seq_lens, 0.25, tail, kernels)
    expected = naive_rows_attention(q, k_pool, v_pool, table, rows, seq_lens, tail, 0.25)
    assert torch.allclose(got, expected, atol=1e-5)
    indices, lens = explicit_rows(table, rows[:1], seq_lens[:1], tail[:1])
    # by hand: row 0's one prefix slot, its three tail slots, slot 0 beyond
    assert lens.tolist() == [4]
    assert indices[0, :4].tolist() == [int(table[0, 0])] + tail[0].tolist()
    assert indices[0, 4:].eq(0).all()


def dense_draft(drafter, rows: torch.Tensor, seq_lens: torch.Tensor, steps: int):
    """The expansion with the verified prefix's keys gathered per request and each level's
    keys kept in lists, every node attending under an explicit ancestor mask."""
    k, B = drafter.topk, rows.shape[0]
    head = drafter.head
    levels = TreeExpansion(drafter.topk_logprobs[rows], drafter.topk_ids[rows])
    longest = int(seq_lens.max())
    slots = drafter.req_to_token.table[rows, :longest]
    visible = torch.arange(longest)[None, :] < seq_lens[:, None]
    prefix_k = drafter.kv_pool.k[0][slots.masked_fill(~visible, 0)]
    prefix_v = drafter.kv_pool.v[0][slots.masked_fill(~visible, 0)]
    tree_k: list[torch.Tensor] = []
    tree_v: list[torch.Tensor] = []
    ancestors = torch.eye(k, dtype=torch.bool).expand(B, k, k)
    hidden = drafter.last_hidden[rows][:, None, :].expand(B, k, -1)
    for step in range(1, steps):
        mask = torch.cat((visible[:, None, :].expand(B, k, -1), ancestors), dim=-1)

        def attend(q, key, value, mask=mask):
            tree_k.append(key.view(B, k, *key.shape[1:]))
            tree_v.append(value.view(B, k, *value.shape[1:]))
            keys = torch.cat((prefix_k, *tree_k), dim=1).transpose(1, 2)
            values = torch.cat((prefix_v, *tree_v), dim=1).transpose(1, 2)
            queries = q.view(B, k, *q.shape[1:]).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=mask[:, None],
                scale=drafter.scaling,
                enable_gqa=True,
            )
            return out.transpose(1, 2).reshape(B * k, -1)

        positions = (seq_lens + step - 1)[:, None].expand(B, k).reshape(-1)
        out = head(levels.frontier_tokens.reshape(-1), hidden.reshape(B * k, -1), positions, attend)
        levels.add_level(torch.log_softmax(head.logits(out), dim=-1), head.to_target_ids)
        if step == steps - 1:
            break
        parent = levels.advance()[:, :, None]
        out = out.view(B, k, -1)
        hidden = out.gather(1, parent.expand(B, k, out.shape[-1]))
        inherited = ancestors.gather(1, parent.expand(B, k, ancestors.shape[-1]))
        ancestors = torch.cat((inherited, torch.eye(k, dtype=torch.bool).expand(B, k, k)), -1)
    return levels.result()


@pytest.fixture
def prefilled(peaky_model_dir, eagle3_head):  # noqa: F811
    """An EAGLE3 scheduler (top-3, 4 levels) after the prefill of 5 prompts of different
    lengths: the head's top-k known at every request's root."""
    s = make_spec_scheduler(
        peaky_model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=eagle3_head,
        speculative_eagle_topk=3,
        speculative_num_steps=4,
        speculative_num_draft_tokens=10,
    )
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=4)) for i, p in enumerate(prompts(5))]
    for req in reqs:
        s.add_request(req)
    s.step()
    yield s, reqs
    while s.has_work:
        s.step()


def _inputs(reqs):
    rows = torch.tensor([r.req_pool_idx for r in reqs])
    seq_lens = torch.tensor([len(r.input_ids) for r in reqs])
    return rows, seq_lens


def _same_candidates(got, expected) -> None:
    scores, tokens, parents = got
    assert torch.allclose(scores, expected[0], atol=1e-4)
    assert torch.equal(tokens, expected[1]) and torch.equal(parents, expected[2])


def test_the_draft_levels_equal_the_dense_reference(prefilled):
    s, reqs = prefilled
    drafter = s.worker.drafter
    rows, seq_lens = _inputs(reqs)
    assert len(set(seq_lens.tolist())) > 1
    for steps in (1, 2, 4):
        _same_candidates(
            drafter.draft(rows, seq_lens, steps), dense_draft(drafter, rows, seq_lens, steps)
        )


def test_the_static_path_pads_and_slices_to_the_eager_candidates(prefilled):
    """Batch sizes 1, 2 and 4 static: 1, 3 (padded to 4) and 4 requests through it, 5 eagerly;
    each the eager expansion's candidates."""
    s, reqs = prefilled
    drafter = s.worker.drafter
    summary = drafter.use_graphs([1, 2, 4])
    assert summary["batch_sizes"] == [1, 2, 4] and summary["depths"] == [2, 3, 4]
    assert not summary["captured"]
    graphs = drafter.graphs
    for count in (1, 3, 4, 5):
        rows, seq_lens = _inputs(reqs[:count])
        runs = graphs.static_runs
        got = drafter.draft(rows, seq_lens, 4)
        assert graphs.static_runs == runs + (count <= 4)
        if count == 3:  # the fourth request of the bucket is padding: the dummy row, one key
            dummy = s.worker.target.req_to_token.dummy_row
            assert graphs.rows[:4].tolist() == rows.tolist() + [dummy]
            assert graphs.seq_lens[3].item() == 1
        _same_candidates(got, drafter.expand(rows, seq_lens, 4))


def _fake_round(s, reqs, counts: list[int], seed: int = 0):
    """Accepted positions after each request's prompt, `counts[b]` of them, at free slots
    written into the table rows, with random tokens and features: (the round's verify batch as
    the head reads it, its prefix lens, its tokens, its slots, its features)."""
    drafter = s.worker.drafter
    gen = torch.Generator().manual_seed(seed)
    num_slots = s.worker.target.num_kv_slots
    slots = torch.arange(num_slots - sum(counts), num_slots)  # the pool's last: never taken here
    rows = [r.req_pool_idx for r in reqs]
    prefix_lens = [len(r.input_ids) for r in reqs]
    tokens, start = [], 0
    for row, prefix, n in zip(rows, prefix_lens, counts):
        drafter.req_to_token.write(row, prefix, slots[start : start + n])
        tokens.append(torch.randint(0, 1000, (n,), generator=gen).tolist())
        start += n
    features = torch.randn(sum(counts), drafter.head.cfg.feature_size, generator=gen)
    batch = SimpleNamespace(req_pool_indices=torch.tensor(rows), rows_host=rows)
    return batch, prefix_lens, tokens, slots, features


def _head_state(drafter, rows, slots) -> list[torch.Tensor]:
    pool = drafter.kv_pool
    return [
        drafter.topk_logprobs[rows].clone(),
        drafter.topk_ids[rows].clone(),
        drafter.last_hidden[rows].clone(),
        pool.k[0][slots].clone(),
        pool.v[0][slots].clone(),
    ]


def _extend_and_restore(drafter, round_):
    """The head's state after an eager extend over `round_` (`_fake_round`'s), the state
    before it put back: (before, after)."""
    batch, prefix_lens, tokens, slots, features = round_
    rows = batch.req_pool_indices
    before = _head_state(drafter, rows, slots)
    drafter.extend(round_draft_batch(batch, prefix_lens, tokens, slots), features)
    after = _head_state(drafter, rows, slots)
    drafter.topk_logprobs[rows], drafter.topk_ids[rows], drafter.last_hidden[rows] = before[:3]
    drafter.kv_pool.write(0, slots, before[3], before[4])
    return before, after


def _same_state(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected):
        if a.dtype == torch.int64:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_the_static_extend_after_a_round_equals_the_eager_extend(prefilled):
    """A round's extend through ExtendGraphs (3 requests padded to 4, accepting 1, 5 and 2
    tokens) leaves the head's top-k, last output and KV as the eager extend does; 5 requests
    or a request past the width do not fit the static path and leave everything untouched."""
    s, reqs = prefilled
    drafter = s.worker.drafter
    round_ = _fake_round(s, reqs[:3], [1, 5, 2])
    batch, prefix_lens, tokens, slots, features = round_
    rows = batch.req_pool_indices
    before, eager = _extend_and_restore(drafter, round_)
    assert all(torch.equal(a, b) for a, b in zip(_head_state(drafter, rows, slots), before))

    summary = drafter.use_graphs([1, 2, 4])
    assert summary["extend"] == {
        "captured": False, "batch_sizes": [1, 2, 4], "width": 5, "capture_s": 0.0,
        "memory_mib": 0.0,
    }  # fmt: skip
    graphs = drafter.extend_graphs
    assert graphs.run(batch.rows_host, prefix_lens, tokens, slots, features)
    dummy = s.worker.target.req_to_token.dummy_row
    assert graphs.rows[:4].tolist() == batch.rows_host + [dummy]
    # request b's tokens at b * 5 on, the rest padding at slot 0
    assert graphs.slots[:20].tolist() == (
        slots[:1].tolist() + [0] * 4 + slots[1:6].tolist() + slots[6:8].tolist() + [0] * 8
    )
    _same_state(_head_state(drafter, rows, slots), eager)
    assert graphs.static_runs == 1

    wide = _fake_round(s, reqs[:1], [6], seed=1)
    many = _fake_round(s, reqs, [1] * 5, seed=2)
    for batch, prefix_lens, tokens, slots, features in (wide, many):
        state = _head_state(drafter, batch.req_pool_indices, slots)
        assert not graphs.run(batch.rows_host, prefix_lens, tokens, slots, features)
        after = _head_state(drafter, batch.req_pool_indices, slots)
        assert all(torch.equal(a, b) for a, b in zip(after, state))
    assert graphs.static_runs == 1


def test_the_heads_extend_attends_through_the_cpu_kernels_as_torch_does(prefilled):
    """With the CPU kernels loaded the head's extends (after a round, and at a stale row's
    last position) attend through the decode kernel, as the target's do: the top-k, last
    output and KV they leave equal those of the plain torch backend (gathered keys, SDPA)."""
    s, reqs = prefilled
    drafter = s.worker.drafter
    assert drafter.backend._has_decode_kernel
    round_ = _fake_round(s, reqs[:3], [1, 5, 2])
    _, kernel = _extend_and_restore(drafter, round_)
    drafter.backend = create_attention_backend(
        "torch", drafter.kv_pool, drafter.req_to_token, drafter.scaling, "cpu"
    )
    assert not drafter.backend._has_decode_kernel
    _same_state(_extend_and_restore(drafter, round_)[1], kernel)
