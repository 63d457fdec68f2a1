"""The custom-mask (tree) path: attending over a token tree under its mask gives each node what
running its root-to-node path alone would give."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.attention.torch_backend import query_row_slots
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.worker_io import WorkerBatch
from spectral.worker.model_worker import ModelWorker
from tests.conftest import make_worker


@pytest.fixture(scope="module", params=[True, False], ids=["cpu-kernels", "sdpa"])
def worker(request: pytest.FixtureRequest, tiny_model_dir: str) -> ModelWorker:
    """With the CPU kernels a tree runs through the decode-attention kernel (a row per node
    over its prefix and ancestors); without them, through SDPA under the mask."""
    return make_worker(tiny_model_dir, 2048, 256, use_cpu_kernels=request.param)


@st.composite
def trees(draw):
    """(prefix tokens, tree tokens, parents) with parents[i] < i, -1 for children of the prefix."""
    prefix = draw(st.lists(st.integers(3, 49151), min_size=1, max_size=20))
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(3, 49151), min_size=n, max_size=n))
    return prefix, tokens, parents


def ancestors(parents: list[int], i: int) -> list[int]:
    """Root-to-node path of tree node i (inclusive)."""
    path = []
    while i != -1:
        path.append(i)
        i = parents[i]
    return path[::-1]


def extend(worker, row, ids, prefix, slots, mode=ForwardMode.EXTEND, positions=None, mask=None):
    wb = WorkerBatch(
        mode=mode,
        input_ids=ids[prefix:],
        positions=positions if positions is not None else list(range(prefix, len(ids))),
        out_cache_loc=slots[prefix : len(ids)],
        req_pool_indices=[row],
        prefix_lens=[prefix],
        extend_lens=[len(ids) - prefix],
        sampling=[],
        custom_mask=mask,
    )
    fb = worker.to_forward_batch(wb)
    fb.logits_rows = "all"
    return worker.forward_logits(fb)


@settings(max_examples=25, deadline=None)
@given(trees())
def test_tree_node_logits_equal_its_path_run_alone(worker, tree):
    prefix, tokens, parents = tree
    p, n = len(prefix), len(tokens)
    slots = list(range(1, p + n + 1))
    extend(worker, 0, prefix, 0, slots)

    paths = [ancestors(parents, i) for i in range(n)]
    mask = [j in paths[i] for i in range(n) for j in range(n)]
    positions = [p + len(path) - 1 for path in paths]
    tree_logits = extend(
        worker, 0, prefix + tokens, p, slots, ForwardMode.TARGET_VERIFY, positions, mask
    )

    for i, path in enumerate(paths):
        ids = prefix + [tokens[j] for j in path]
        alone = extend(worker, 1, ids, 0, list(range(1000, 1000 + len(ids))))
        assert (tree_logits[i] - alone[-1]).abs().max().item() < 1e-4


def test_two_trees_in_one_batch_match_separate_runs(worker):
    """Requests with different prefix and tree sizes, batched (padding must stay invisible)."""
    specs = [
        ([5, 6, 7, 8, 9], [10, 11, 12], [-1, 0, 0]),
        ([20, 21], [30, 31, 32, 33, 34], [-1, 0, 1, 1, 3]),
    ]
    expected = []
    base = 1
    layout = []
    for row, (prefix, tokens, parents) in enumerate(specs):
        slots = list(range(base, base + len(prefix) + len(tokens)))
        base += len(slots)
        extend(worker, row, prefix, 0, slots)
        paths = [ancestors(parents, i) for i in range(len(tokens))]
        for path in paths:
            ids = prefix + [tokens[j] for j in path]
            expected.append(extend(worker, 3, ids, 0, list(range(1500, 1500 + len(ids))))[-1])
        layout.append((slots, paths))
    input_ids, positions, loc, mask = [], [], [], []
    for (prefix, tokens, _), (slots, paths) in zip(specs, layout):
        n = len(tokens)
        input_ids += tokens
        positions += [len(prefix) + len(path) - 1 for path in paths]
        loc += slots[len(prefix) :]
        mask += [j in paths[i] for i in range(n) for j in range(n)]
    wb = WorkerBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=loc,
        req_pool_indices=[0, 1],
        prefix_lens=[len(s[0]) for s in specs],
        extend_lens=[len(s[1]) for s in specs],
        sampling=[],
        custom_mask=mask,
    )
    logits = worker.forward_logits(worker.to_forward_batch(wb))
    assert logits.shape[0] == len(expected)
    for got, want in zip(logits, expected):
        assert (got - want).abs().max().item() < 1e-4


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 9), st.integers(1, 6), st.integers(0, 2**16)),
        min_size=1,
        max_size=4,
    ),
    causal=st.booleans(),
)
def test_query_row_slots_match_a_row_by_row_reference(requests, causal):
    """Each new token's row (the batch built at once) against its row written out alone: the
    request's prefix slots, then the slots of the new tokens its mask shows, in order."""
    table = torch.arange(1000, 1000 + 6 * 20, dtype=torch.int64).view(6, 20)
    rows = list(range(len(requests)))[::-1]
    masks, expected = [], []
    for row, (prefix, n, seed) in zip(rows, requests):
        rng = random.Random(seed)
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
        for i in range(n):
            seen = list(range(i + 1)) if causal else sorted(ancestors(parents, i))
            masks.extend(j in seen for j in range(n))
            expected.append(
                table[row, :prefix].tolist() + [int(table[row, prefix + j]) for j in seen]
            )
    batch = ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=torch.zeros(len(expected), dtype=torch.int64),
        positions=torch.zeros(len(expected), dtype=torch.int64),
        out_cache_loc=torch.zeros(len(expected), dtype=torch.int64),
        req_pool_indices=torch.tensor(rows),
        prefix_lens=[p for p, _, _ in requests],
        extend_lens=[n for _, n, _ in requests],
        custom_mask=None if causal else torch.tensor(masks),
    )
    kv_indices, lens = query_row_slots(batch, table)
    assert lens.tolist() == [len(e) for e in expected]
    width = max(p + n for p, n, _ in requests)
    assert kv_indices.tolist() == [e + [0] * (width - len(e)) for e in expected]
