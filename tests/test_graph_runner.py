"""The graph runner's static-buffer path on the CPU (what a GPU captures and replays): bucket
choice, padding to the bucket (dummy row, dummy slot, padding tree nodes), the real rows sliced
back, against the eager forward of the same batch, and engines with it against engines
without, token for token in float32 (plain decoding and EAGLE3 tree verification, requests
joining and leaving between steps)."""

from __future__ import annotations

import random

import pytest
import torch

from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.worker_io import WorkerBatch
from spectral.worker.graph_runner import Bucket, plan_buckets
from spectral.worker.model_worker import ModelWorker
from tests.conftest import scheduler_leaks
from tests.test_speculative import make_random_head

BATCH_SIZES = [1, 2, 4, 8]


def test_buckets_planned_for_decode_and_each_tree_size_up_to_the_largest():
    buckets = plan_buckets([1, 2, 4, 8], max_tree_tokens=6, verify_max_batch_size=4)
    decode = [b.requests for b in buckets if b.tokens == 1]
    verify = sorted({(b.tokens, b.requests) for b in buckets if b.tokens > 1})
    assert decode == [1, 2, 4, 8]
    assert verify == [(n, bs) for n in (2, 4, 6) for bs in (1, 2, 4)]
    # no tree bucket of more than 512 tokens
    big = plan_buckets([1, 64, 128], max_tree_tokens=8, verify_max_batch_size=None)
    assert Bucket(8, 64) in big and Bucket(8, 128) not in big


@pytest.fixture(scope="module")
def worker(peaky_model_dir: str) -> ModelWorker:
    worker = ModelWorker(
        peaky_model_dir,
        dtype=torch.float32,
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=16,
        max_context_len=256,
    )
    worker.use_graphs(BATCH_SIZES, max_tree_tokens=8, verify_max_batch_size=8)
    return worker


def _batch(
    worker: ModelWorker, mode: ForwardMode, rows, prefixes, trees, first_slot
) -> WorkerBatch:
    """Requests in table `rows` after `prefixes` cached tokens, each with a tree given as
    parents (node i's parent; -1 the root) in TARGET_VERIFY, or one token in DECODE; slots
    from `first_slot` on."""
    rng = random.Random(sum(prefixes) + len(rows))
    ids, positions, mask, sizes = [], [], [], []
    for prefix, parents in zip(prefixes, trees):
        n = len(parents)
        depth = [0] * n
        seen = [[False] * n for _ in range(n)]
        for i, p in enumerate(parents):
            if p >= 0:
                depth[i] = depth[p] + 1
                seen[i] = list(seen[p])
            seen[i][i] = True
        ids += [rng.randrange(3, 1000) for _ in range(n)]
        positions += [prefix + d for d in depth]
        mask += [bit for row in seen for bit in row]
        sizes.append(n)
    total = sum(sizes)
    return WorkerBatch(
        mode=mode,
        input_ids=ids,
        positions=positions,
        out_cache_loc=list(range(first_slot, first_slot + total)),
        req_pool_indices=list(rows),
        prefix_lens=list(prefixes),
        extend_lens=sizes,
        sampling=[],
        custom_mask=mask if mode == ForwardMode.TARGET_VERIFY else None,
    )


def _prefill(worker: ModelWorker, rows: list[int], lengths: list[int]) -> None:
    """Cache `lengths[i]` random tokens for request row rows[i] (slots 1.., row after row)."""
    rng = random.Random(7)
    slot = 1
    for row, n in zip(rows, lengths):
        wb = WorkerBatch(
            mode=ForwardMode.EXTEND,
            input_ids=[rng.randrange(3, 1000) for _ in range(n)],
            positions=list(range(n)),
            out_cache_loc=list(range(slot, slot + n)),
            req_pool_indices=[row],
            prefix_lens=[0],
            extend_lens=[n],
            sampling=[],
        )
        worker.forward_batch(worker.to_forward_batch(wb))
        slot += n


def _both_ways(worker: ModelWorker, wb: WorkerBatch):
    """The batch through the graph runner and eagerly (the runner set aside)."""
    batch: ForwardBatch = worker.to_forward_batch(wb)
    bucket = worker.graphs.bucket_for(batch)
    through = worker.forward_batch(batch)
    through = (through[0], through[1], through[2].clone())
    graphs, worker.graphs = worker.graphs, None
    try:
        eager = worker.forward_batch(worker.to_forward_batch(wb))
    finally:
        worker.graphs = graphs
    return bucket, through, eager


def _assert_same_forward(hidden, logits, hidden_e, logits_e) -> None:
    """The same rows as the eager forward: equal up to the matmuls' rounding (a tile of 4
    rows sums in another order than one of 3), the same greedy token in every row."""
    torch.testing.assert_close(hidden, hidden_e, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, logits_e, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), logits_e.argmax(-1))


ROWS = list(range(10))
PREFIXES = [5, 17, 3, 40, 9, 12, 30, 7, 22, 11]


@pytest.fixture(scope="module")
def cached(worker: ModelWorker) -> ModelWorker:
    _prefill(worker, ROWS, PREFIXES)
    return worker


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 8, 9])
def test_decode_through_the_buckets_equals_eager(cached, size):
    """Every batch size around the bucket boundaries: padded to the next bucket (or eager past
    the largest), the real rows' logits and hidden states are the eager forward's."""
    rows = ROWS[:size]
    wb = _batch(cached, ForwardMode.DECODE, rows, PREFIXES[:size], [[-1]] * size, 1500)
    bucket, (hidden, _, logits), (hidden_e, _, logits_e) = _both_ways(cached, wb)
    expected = next((bs for bs in BATCH_SIZES if bs >= size), None)
    assert (bucket.requests if bucket else None) == expected
    assert logits.shape == logits_e.shape == (size, cached.config.vocab_size)
    _assert_same_forward(hidden, logits, hidden_e, logits_e)


TREES = {
    "chains of the bucket's size": [[-1, 0, 1, 2]] * 3,
    "ragged, padded to 4 and 8": [[-1, 0, 0, 1, 1], [-1], [-1, 0, 1], [-1, 0, 0, 0, 2, 2, 3]],
    "one request, the largest tree": [[-1, 0, 0, 1, 1, 2, 2, 3]],
    "five requests, padded to eight": [[-1, 0]] * 5,
}


@pytest.mark.parametrize("trees", list(TREES.values()), ids=list(TREES))
def test_tree_verification_through_the_buckets_equals_eager(cached, trees):
    """Trees padded with nodes that see only themselves, requests padded with the dummy
    row: the real nodes' logits are the eager forward's, in request order."""
    n = len(trees)
    wb = _batch(cached, ForwardMode.TARGET_VERIFY, ROWS[:n], PREFIXES[:n], trees, 1600)
    bucket, (hidden, _, logits), (hidden_e, _, logits_e) = _both_ways(cached, wb)
    assert bucket is not None and bucket.tokens >= max(map(len, trees))
    assert logits.shape[0] == sum(map(len, trees))
    _assert_same_forward(hidden, logits, hidden_e, logits_e)


def test_batches_no_bucket_holds_run_eagerly(cached):
    too_many = _batch(cached, ForwardMode.DECODE, ROWS[:9], PREFIXES[:9], [[-1]] * 9, 1500)
    big_tree = _batch(cached, ForwardMode.TARGET_VERIFY, [0], [5], [[-1] + list(range(8))], 1600)
    prefill = _batch(cached, ForwardMode.DECODE, [0], [5], [[-1]], 1500)
    prefill.mode = ForwardMode.EXTEND
    for wb in (too_many, big_tree, prefill):
        assert cached.graphs.bucket_for(cached.to_forward_batch(wb)) is None
    other_layers = cached.to_forward_batch(
        _batch(cached, ForwardMode.DECODE, [0], [5], [[-1]], 1500)
    )
    other_layers.capture_layers = (1,)
    assert cached.graphs.bucket_for(other_layers) is None


def _generate(model_dir: str, prompts, params, repeat: bool = False, **options):
    """(outputs, verify rounds, graph summary) of one engine; with `repeat`, of its second
    run over the same requests."""
    from spectral import Engine

    engine = Engine(model_path=model_dir, dtype="float32", max_total_tokens=4096, **options)
    try:
        if repeat:
            engine.generate(input_ids=prompts, sampling_params=params)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        rounds = engine.scheduler.stats.spec_verify_ct
        assert scheduler_leaks(engine.scheduler) == []
        info = engine.worker.graph_info() if options.get("cuda_graph_bs") else None
        graphs = getattr(getattr(engine.worker, "drafter", None), "graphs", None)
        if info is not None and graphs is not None:
            info["draft_static_runs"] = graphs.static_runs
            extends = getattr(engine.worker.drafter, "extend_graphs", None)
            info["extend_static_runs"] = extends.static_runs if extends else None
            info["rounds_on_device"] = engine.worker.rounds_on_device
            info["round_static_runs"] = engine.worker.round_graphs.static_runs
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in outs], rounds, info


def _requests(count: int):
    prompts = [[5 + i, 40 + 3 * i, 7, 300 + i, 11, 12][: 2 + i % 5] for i in range(count)]
    # different lengths: requests leave the batch at different steps, its size crosses buckets
    params = [
        {"temperature": 0, "max_new_tokens": 6 + 5 * i, "ignore_eos": True} for i in range(count)
    ]
    return prompts, params


def test_plain_engine_through_the_buckets_gives_eager_tokens(peaky_model_dir):
    prompts, params = _requests(10)
    eager, _, _ = _generate(peaky_model_dir, prompts, params)
    graphed, _, info = _generate(peaky_model_dir, prompts, params, cuda_graph_bs=[1, 2, 4, 8])
    assert graphed == eager
    assert info["decode_batch_sizes"] == [1, 2, 4, 8] and not info["captured"]


def test_eagle3_engine_through_the_buckets_gives_plain_tokens(peaky_model_dir, tmp_path):
    """Fixed trees of 6 nodes (padded to the 6-node bucket), batches of 1-6 requests."""
    head = make_random_head(tmp_path / "head", peaky_model_dir, "eagle3")
    prompts, params = _requests(6)
    plain, _, _ = _generate(peaky_model_dir, prompts, params)
    eagle3 = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": head,
        "speculative_fixed_tree": True,
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 6,
        "speculative_max_batch_size": 8,
        "speculative_hybrid_ngram": 0,
    }
    spec, rounds, info = _generate(
        peaky_model_dir, prompts, params, cuda_graph_bs=[1, 2, 4], **eagle3
    )
    assert spec == plain
    assert rounds > 10
    assert info["verify_tree_sizes"] == [2, 4, 6]
    # the head drafted through its static buffers too (batches of up to 4 requests)
    assert info["draft"]["batch_sizes"] == [1, 2, 4] and info["draft_static_runs"] > 5
    # and extended after each round through them (every round drafted by the head)
    assert info["extend_static_runs"] == info["draft_static_runs"]
    # greedy, no grammar: every round selected its trees and accepted on the device, through
    # static buffers where the head drafted through them
    assert info["rounds_on_device"] == rounds
    assert info["round_static_runs"] == info["draft_static_runs"]
    assert info["draft"]["round"]["batch_sizes"] == [1, 2, 4]


def test_ngram_trees_of_many_sizes_give_plain_tokens(peaky_model_dir):
    """n-gram trees: the same requests twice, the second time drafted from the first's
    outputs, whose lengths differ, so trees of several sizes share a batch (padded within
    their bucket)."""
    prompts, params = _requests(4)
    plain, _, _ = _generate(peaky_model_dir, prompts + prompts, params + params)
    ngram = {
        "speculative_algorithm": "NGRAM",
        "speculative_fixed_tree": True,
        "speculative_max_batch_size": 4,
    }
    graphed = {"cuda_graph_bs": [1, 2, 4]}
    spec, rounds, _ = _generate(peaky_model_dir, prompts, params, True, **graphed, **ngram)
    assert spec == plain[4:]
    assert rounds > 0
