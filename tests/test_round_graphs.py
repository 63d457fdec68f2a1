"""A greedy round's selection and walk through static buffers (worker/round_graphs.py: CUDA
graphs on a GPU, the same buffers eagerly here) against the eager functions they replace, with
requests padded to the batch size that holds them."""

from __future__ import annotations

import math
import random

import torch

from spectral.speculative.tree import select_eagle_trees
from spectral.speculative.verify import accept_greedy_on_device
from spectral.worker.round_graphs import RoundGraphs


def _candidates(rng: random.Random, batch: int, count: int, topk: int):
    """Candidates as a drafter gives them: the first `topk` under the root, every later one
    under an earlier one, cumulative log-probabilities that never grow from parent to child."""
    scores = torch.empty(batch, count)
    parents = torch.empty(batch, count, dtype=torch.int64)
    for b in range(batch):
        for c in range(count):
            parent = -1 if c < topk else rng.randrange(c)
            base = 0.0 if parent < 0 else float(scores[b, parent])
            parents[b, c] = parent
            scores[b, c] = base + math.log(rng.uniform(0.01, 1.0))
    tokens = torch.randint(0, 50, (batch, count), generator=torch.Generator().manual_seed(3))
    return scores, tokens, parents


def test_the_static_selection_and_walk_equal_the_eager_ones():
    rng = random.Random(7)
    graphs = RoundGraphs([1, 2, 4], "cpu")
    for sizes, count in (([5, 3, 8], 20), ([2], 4), ([6, 6], 3), ([4, 7, 2, 3], 12)):
        real = len(sizes)
        scores, tokens, parents = _candidates(rng, real, count, topk=min(3, count))
        roots = torch.arange(100, 100 + real)
        wanted = torch.tensor([s - 1 for s in sizes])
        expected = select_eagle_trees(roots, scores, tokens, parents, sizes, on_device=True)
        runs = graphs.static_runs
        got = graphs.select(roots, scores, tokens, parents, wanted, sizes)
        assert graphs.static_runs == runs + 1
        for field in ("tokens", "parents", "depths", "mask", "next_token", "next_sibling", "ranks"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), (sizes, field)
        assert got.num_nodes == expected.num_nodes
        # the target's choices: each node's own token at half the nodes (paths get accepted),
        # random elsewhere, -1 at padding nodes
        n = max(sizes)
        choices = torch.randint(0, 50, (real, n))
        follow = torch.rand(real, n) < 0.5
        children = expected.next_token.clamp(min=0)
        choices = torch.where(follow, expected.tokens.gather(1, children), choices)
        choices[torch.arange(n)[None, :] >= torch.tensor(expected.num_nodes)[:, None]] = -1
        packed = accept_greedy_on_device(expected, choices)
        eager = torch.cat((packed.double(), expected.ranks.double(), scores.double()), 1)
        assert graphs.accept(choices) == eager.tolist(), sizes
    # one buffer set per (batch size, tree size, candidates) shape
    assert sorted(key[:2] for key in graphs.shapes) == [(1, 2), (2, 6), (4, 7), (4, 8)]


def test_a_round_larger_than_every_batch_size_is_left_to_the_eager_path():
    graphs = RoundGraphs([1, 2], "cpu")
    scores, tokens, parents = _candidates(random.Random(1), 3, 6, topk=2)
    wanted = torch.tensor([2, 2, 2])
    got = graphs.select(torch.arange(3), scores, tokens, parents, wanted, [3, 3, 3])
    assert got is None and graphs.accept(torch.zeros(3, 3, dtype=torch.int64)) is None
    assert graphs.static_runs == 0
