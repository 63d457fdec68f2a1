"""Draft trees and their verification: the EAGLE-2 rerank on written-out score tables, the
tree layout as a property of any table a draft can produce, greedy verification on small
trees, and the lossless sampling rule checked by chi-square tests against the target's chain
distribution."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.speculative.tree import (
    DraftTrees,
    _assemble,
    merge_tree_nodes,
    select_eagle_trees,
    tree_positions,
    trees_from_parents,
)
from spectral.speculative.verify import (
    accept_greedy_on_device,
    unpack_accepted,
    verify_greedy,
    verify_sampling,
)

NAN = float("nan")
INF = float("inf")


def t(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def mask_of(rows: list[str]) -> torch.Tensor:
    """A mask written as strings of 0/1, one per node."""
    return torch.tensor([[c == "1" for c in row] for row in rows])


def assert_tree(trees: DraftTrees, b: int, **expected: object) -> None:
    for field, value in expected.items():
        actual = getattr(trees, field)[b]
        if field == "num_nodes":
            assert actual == value, field
        else:
            assert torch.equal(actual, value if field == "mask" else t(value)), field


# ---- select_eagle_trees on hand-made tables -----------------------------------------------
#
# topk 2, 3 steps: C = 2 + 2 * 4 = 10 candidates.
#   step 0: c0 (tok 10, -0.1), c1 (tok 11, -0.5)                          children of the root
#   step 1: c2 (20, -0.3), c3 (21, -1.2) under c0; c4 (22, -0.7), c5 (23, -2.0) under c1
#   step 2: c6 (30, -0.4), c7 (31, -1.5) under c2; c8 (32, -0.9), c9 (33, -3.0) under c4
# By score: c0 c2 c6 c1 c4 c8 c3 c7 c5 c9.

SCORES = [-0.1, -0.5, -0.3, -1.2, -0.7, -2.0, -0.4, -1.5, -0.9, -3.0]
TOKENS = [10, 11, 20, 21, 22, 23, 30, 31, 32, 33]
PARENTS = [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]
ROOT = 7


def select(scores: list[float], tokens: list[int], parents: list[int], n: int) -> DraftTrees:
    return select_eagle_trees(t([ROOT]), torch.tensor([scores]), t([tokens]), t([parents]), n)


def test_select_keeps_the_four_best_candidates_in_candidate_order() -> None:
    trees = select(SCORES, TOKENS, PARENTS, n=5)  # picks c0 c2 c6 c1 -> rows c0 c1 c2 c6
    assert_tree(
        trees,
        0,
        tokens=[ROOT, 10, 11, 20, 30],
        parents=[-1, 0, 0, 1, 3],
        depths=[0, 1, 1, 2, 3],
        mask=mask_of(["10000", "11000", "10100", "11010", "11011"]),
        next_token=[1, 3, -1, 4, -1],
        next_sibling=[-1, 2, -1, -1, -1],
        num_nodes=5,
    )


def test_select_keeps_the_seven_best_candidates_in_candidate_order() -> None:
    trees = select(SCORES, TOKENS, PARENTS, n=8)  # rows c0 c1 c2 c3 c4 c6 c8
    assert_tree(
        trees,
        0,
        tokens=[ROOT, 10, 11, 20, 21, 22, 30, 32],
        parents=[-1, 0, 0, 1, 1, 2, 3, 5],
        depths=[0, 1, 1, 2, 2, 2, 3, 3],
        mask=mask_of(
            [
                "10000000",
                "11000000",
                "10100000",
                "11010000",
                "11001000",
                "10100100",
                "11010010",
                "10100101",
            ]
        ),
        next_token=[1, 3, 5, 6, -1, 7, -1, -1],
        next_sibling=[-1, 2, -1, 4, -1, -1, -1, -1],
        num_nodes=8,
    )


def test_select_breaks_ties_towards_the_lower_candidate_so_parents_come_first() -> None:
    # c2 scores the same as its parent c1, c4 the same as its parent c0; c0 and c4 tie for
    # the last place. By score, stable: c1 c2 c0 c4 c3 c5 -> picks c1 c2 c0.
    scores = [-1.0, -0.5, -0.5, -3.0, -1.0, -2.0]
    tokens = [10, 11, 12, 13, 14, 15]
    parents = [-1, -1, 1, 1, 0, 0]
    trees = select(scores, tokens, parents, n=4)
    assert_tree(trees, 0, tokens=[ROOT, 10, 11, 12], parents=[-1, 0, 0, 2], num_nodes=4)


def test_select_ranks_nan_scores_last() -> None:
    scores = [NAN, -0.5, NAN, NAN, -0.6, -0.7]
    tokens = [10, 11, 20, 21, 22, 23]
    parents = [-1, -1, 0, 0, 1, 1]
    trees = select(scores, tokens, parents, n=5)  # c1 c4 c5, then c0 (NaN, lowest index)
    assert_tree(trees, 0, tokens=[ROOT, 10, 11, 22, 23], parents=[-1, 0, 0, 2, 2])


def test_select_drops_a_candidate_whose_parent_was_not_picked_and_pads() -> None:
    # c0 is NaN but its children are finite: c2 and c3 are picked without c0 and dropped.
    scores = [NAN, -0.5, -0.3, -0.4, -0.6, -5.0]
    tokens = [10, 11, 20, 21, 22, 23]
    parents = [-1, -1, 0, 0, 1, 1]
    trees = select(scores, tokens, parents, n=4)  # picks c2 c3 c1
    assert_tree(
        trees,
        0,
        tokens=[ROOT, 11, 0, 0],
        parents=[-1, 0, -1, -1],
        depths=[0, 1, 0, 0],
        mask=mask_of(["1000", "1100", "0010", "0001"]),
        next_token=[1, -1, -1, -1],
        next_sibling=[-1, -1, -1, -1],
        num_nodes=2,
    )


def test_select_pads_when_there_are_fewer_candidates_than_nodes() -> None:
    trees = select([-0.2, -0.1], [10, 11], [-1, -1], n=4)
    assert_tree(trees, 0, tokens=[ROOT, 10, 11, 0], parents=[-1, 0, 0, -1], num_nodes=3)


def test_select_with_one_node_gives_the_root_alone() -> None:
    trees = select(SCORES, TOKENS, PARENTS, n=1)
    assert_tree(trees, 0, tokens=[ROOT], parents=[-1], mask=mask_of(["1"]), num_nodes=1)


def test_select_treats_each_request_of_a_batch_on_its_own() -> None:
    other = [-2.0, -0.1, -2.5, -3.0, -0.2, -0.3, -0.25, -4.0, -0.35, -5.0]
    trees = select_eagle_trees(
        t([ROOT, 8]), torch.tensor([SCORES, other]), t([TOKENS, TOKENS]), t([PARENTS] * 2), 5
    )
    assert_tree(trees, 0, tokens=[ROOT, 10, 11, 20, 30], parents=[-1, 0, 0, 1, 3])
    # other by score: c1 c4 c6 c5 -> c6 (under c2) is dropped: its parent c2 was not picked.
    assert_tree(trees, 1, tokens=[8, 11, 22, 23, 0], parents=[-1, 0, 1, 1, -1], num_nodes=4)


def test_select_rejects_a_parent_candidate_that_is_not_earlier() -> None:
    with pytest.raises(ValueError, match="parent candidate"):
        select([-0.1, -0.2], [10, 11], [-1, 1], n=3)


# ---- trees_from_parents ------------------------------------------------------------------


def test_trees_from_parents_lays_out_and_pads_each_tree() -> None:
    trees = trees_from_parents([5, 3], [[6, 7, 8, 9], []], [[0, 0, 1, 1], []], n=6)
    assert_tree(
        trees,
        0,
        tokens=[5, 6, 7, 8, 9, 0],
        parents=[-1, 0, 0, 1, 1, -1],
        depths=[0, 1, 1, 2, 2, 0],
        mask=mask_of(["100000", "110000", "101000", "110100", "110010", "000001"]),
        next_token=[1, 3, -1, -1, -1, -1],
        next_sibling=[-1, 2, -1, 4, -1, -1],
        num_nodes=5,
    )
    assert_tree(
        trees,
        1,
        tokens=[3, 0, 0, 0, 0, 0],
        parents=[-1] * 6,
        depths=[0] * 6,
        mask=torch.eye(6, dtype=torch.bool),
        next_token=[-1] * 6,
        next_sibling=[-1] * 6,
        num_nodes=1,
    )


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    extra=st.integers(0, 3),
    data=st.data(),
)
def test_trees_from_parents_equals_the_tensor_assembly(shapes, extra, data) -> None:
    """The host walk gives every field `_assemble`'s tensor operations derive from the same
    parents (random trees, padded)."""
    n = max(shapes) + 1 + extra
    toks = [data.draw(st.lists(st.integers(0, 50), min_size=k, max_size=k)) for k in shapes]
    pars = [[data.draw(st.integers(0, i)) for i in range(k)] for k in shapes]
    roots = list(range(7, 7 + len(shapes)))
    got = trees_from_parents(roots, toks, pars, n)
    tokens = torch.zeros((len(shapes), n), dtype=torch.int64)
    parents = torch.full((len(shapes), n), -1, dtype=torch.int64)
    for b, (root, tk, pr) in enumerate(zip(roots, toks, pars)):
        tokens[b, : len(tk) + 1] = torch.tensor([root, *tk])
        parents[b, 1 : len(pr) + 1] = torch.tensor(pr, dtype=torch.int64)
    want = _assemble(tokens, parents, [k + 1 for k in shapes])
    for name in ("tokens", "parents", "depths", "mask", "next_token", "next_sibling", "ranks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.num_nodes == want.num_nodes


@pytest.mark.parametrize(
    ("tokens", "parents", "n", "message"),
    [
        ([6, 7], [0, 2], 4, r"request 0: the parent of node 2 must be an earlier node in 0\.\.1 "),
        ([6], [-1], 4, r"the parent of node 1 must be an earlier node in 0\.\.0 \(got -1\)"),
        ([6, 7, 8], [0, 0, 0], 3, r"3 non-root nodes does not fit in num_draft_tokens=3"),
        ([6, 7], [0], 4, r"2 node tokens but 1 node parents"),
    ],
)
def test_trees_from_parents_rejects_invalid_trees(
    tokens: list[int], parents: list[int], n: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        trees_from_parents([5], [tokens], [parents], n)


def test_merge_maps_shared_paths_onto_the_base_and_appends_the_rest() -> None:
    # base: root -> 5 -> 6, root -> 7; extra chain: root -> 5 -> 8 -> 9
    tokens, parents = merge_tree_nodes([5, 7, 6], [0, 0, 1], [5, 8, 9], [0, 1, 2])
    assert tokens == [5, 7, 6, 8, 9]
    assert parents == [0, 0, 1, 1, 4]


def paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Every node's token path from the root (naive: walk up from each node)."""
    out = []
    for i in range(len(tokens)):
        path, node = [], i + 1
        while node:
            path.append(tokens[node - 1])
            node = parents[node - 1]
        out.append(tuple(reversed(path)))
    return out


@st.composite
def node_trees(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """A tree in node form over a small alphabet; siblings may repeat a token (heads can)."""
    size = draw(st.integers(0, 12))
    parents = [draw(st.integers(0, i)) for i in range(size)]
    tokens = [draw(st.integers(0, 3)) for _ in range(size)]
    return tokens, parents


@settings(max_examples=300, deadline=None)
@given(node_trees(), node_trees())
def test_merged_tree_holds_exactly_the_paths_of_both(base, extra) -> None:
    tokens, parents = merge_tree_nodes(*base, *extra)
    assert tokens[: len(base[0])] == base[0] and parents[: len(base[1])] == base[1]
    assert all(0 <= p <= i for i, p in enumerate(parents))
    merged = paths(tokens, parents)
    assert set(merged) == set(paths(*base)) | set(paths(*extra))
    # appended nodes are new paths, each once
    added = merged[len(base[0]) :]
    assert len(added) == len(set(added)) and not set(added) & set(paths(*base))
    trees_from_parents([0], [tokens], [parents], len(tokens) + 1)  # a valid layout


def test_tree_positions_are_seq_len_plus_depth() -> None:
    trees = trees_from_parents([5, 3], [[6, 7, 8], [4]], [[0, 1, 2], [0]], n=4)
    assert torch.equal(tree_positions(trees, t([10, 20])), t([[10, 11, 12, 13], [20, 21, 20, 20]]))


# ---- the tree layout, for any table a draft can produce ----------------------------------

LOGPROBS = st.one_of(
    st.floats(-8.0, -0.01), st.sampled_from([0.0, -0.5, -1.0, -INF])
)  # the fixed values make ties and -inf paths


@st.composite
def draft_tables(draw: st.DrawFn) -> tuple[list[list[float]], list[list[int]], int, int]:
    """Score and parent tables laid out as the EAGLE drafter lays them out: k children of
    the root, then per step k children for each of the k best candidates of the last step."""
    k = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 4))
    batch = draw(st.integers(1, 3))
    num_candidates = k + (steps - 1) * k * k
    n = draw(st.integers(1, num_candidates + 3))
    all_scores, all_parents = [], []
    for _ in range(batch):
        scores = [draw(LOGPROBS) for _ in range(k)]
        parents = [-1] * k
        level = list(range(k))
        for _ in range(steps - 1):
            frontier = sorted(level, key=lambda c: -scores[c])[:k]
            level = []
            for parent in frontier:
                for _ in range(k):
                    level.append(len(scores))
                    scores.append(scores[parent] + draw(LOGPROBS))
                    parents.append(parent)
        all_scores.append(scores)
        all_parents.append(parents)
    return all_scores, all_parents, n, num_candidates


def ancestors(parents: list[int], j: int) -> set[int]:
    found = set()
    while parents[j] >= 0:
        j = parents[j]
        found.add(j)
    return found


def chain(first: list[int], sibling: list[int], i: int) -> list[int]:
    out, j = [], first[i]
    while j != -1:
        out.append(j)
        j = sibling[j]
    return out


@settings(max_examples=200, deadline=None)
@given(draft_tables(), st.lists(st.integers(0, 1000), min_size=3, max_size=3))
def test_selected_trees_are_valid_and_hold_the_best_scores(
    table: tuple[list[list[float]], list[list[int]], int, int], seq_lens: list[int]
) -> None:
    all_scores, all_parents, n, num_candidates = table
    batch = len(all_scores)
    scores = torch.tensor(all_scores, dtype=torch.float32)
    cand_tokens = 1000 + torch.arange(num_candidates).expand(batch, -1)  # token -> candidate
    roots = t(list(range(batch)))
    trees = select_eagle_trees(roots, scores, cand_tokens, t(all_parents), n)
    positions = tree_positions(trees, t(seq_lens[:batch]))
    assert trees.tokens.shape == (batch, n) and trees.mask.shape == (batch, n, n)

    for b in range(batch):
        size = trees.num_nodes[b]
        assert size == min(n, 1 + num_candidates)
        tokens = trees.tokens[b].tolist()
        parents = trees.parents[b].tolist()
        depths = trees.depths[b].tolist()
        first, sibling = trees.next_token[b].tolist(), trees.next_sibling[b].tolist()
        assert tokens[0] == b and parents[0] == -1
        for j in range(n):
            real = j < size
            if real and j > 0:
                assert 0 <= parents[j] < j
            if not real:
                assert (tokens[j], parents[j], first[j], sibling[j]) == (0, -1, -1, -1)
            expected_row = torch.zeros(n, dtype=torch.bool)
            expected_row[list(ancestors(parents, j) | {j})] = True
            assert torch.equal(trees.mask[b, j], expected_row)
            assert depths[j] == len(ancestors(parents, j))
            assert positions[b, j] == seq_lens[b] + depths[j]
            children = [c for c in range(size) if c > 0 and parents[c] == j]
            assert chain(first, sibling, j) == children

        picked = [tok - 1000 for tok in tokens[1:size]]
        assert picked == sorted(picked)  # candidate order
        for j, cand in enumerate(picked, start=1):
            parent_cand = all_parents[b][cand]
            expected_parent = 0 if parent_cand == -1 else picked.index(parent_cand) + 1
            assert parents[j] == expected_parent  # closed under parent, rows mapped right
        chosen = sorted((scores[b, c].item() for c in picked), reverse=True)
        best = sorted(scores[b].tolist(), reverse=True)[: size - 1]
        assert chosen == best


@settings(max_examples=100, deadline=None)
@given(draft_tables())
def test_selection_on_the_device_gives_the_host_selections_trees(
    table: tuple[list[list[float]], list[list[int]], int, int],
) -> None:
    """`on_device` (no host read: scatters instead of compaction, the node count from the
    sizes asked) gives the same trees as the host's selection, for any EAGLE table."""
    all_scores, all_parents, n, num_candidates = table
    batch = len(all_scores)
    scores = torch.tensor(all_scores, dtype=torch.float32)
    cand_tokens = 1000 + torch.arange(num_candidates).expand(batch, -1)
    sizes = [max(1, n - b) for b in range(batch)]  # one size a request
    args = (t(list(range(batch))), scores, cand_tokens, t(all_parents), sizes)
    host, device = select_eagle_trees(*args), select_eagle_trees(*args, on_device=True)
    assert device.num_nodes == host.num_nodes
    for field in ("tokens", "parents", "depths", "mask", "next_token", "next_sibling", "ranks"):
        assert torch.equal(getattr(device, field), getattr(host, field)), field


# ---- verify_greedy -----------------------------------------------------------------------
#
# root 5 -> node 1 (tok 6) -> node 3 (tok 8)
#                          -> node 4 (tok 9)
#        -> node 2 (tok 7)

TREE = trees_from_parents([5], [[6, 7, 8, 9]], [[0, 0, 1, 1]], n=6)


def test_greedy_accepts_nothing_when_the_target_picks_no_child() -> None:
    result = verify_greedy(TREE, t([[4, 8, 1, 1, 1, -1]]))
    assert (result.accepted, result.emitted) == ([[0]], [[4]])


def test_greedy_accepts_a_full_path_and_adds_the_bonus_token() -> None:
    result = verify_greedy(TREE, t([[6, 8, 1, 2, 3, -1]]))
    assert (result.accepted, result.emitted) == ([[0, 1, 3]], [[6, 8, 2]])


def test_greedy_accepts_a_second_sibling() -> None:
    result = verify_greedy(TREE, t([[7, 9, 11, 1, 1, -1]]))
    assert (result.accepted, result.emitted) == ([[0, 2]], [[7, 11]])
    result = verify_greedy(TREE, t([[6, 9, 1, 1, 12, -1]]))
    assert (result.accepted, result.emitted) == ([[0, 1, 4]], [[6, 9, 12]])


def test_greedy_handles_a_batch_with_different_accept_lengths() -> None:
    trees = trees_from_parents([5, 2], [[6, 7, 8, 9], [3, 4]], [[0, 0, 1, 1], [0, 1]], n=6)
    result = verify_greedy(trees, t([[6, 8, 1, 2, 3, -1], [3, 0, 1, -1, -1, -1]]))
    assert result.accepted == [[0, 1, 3], [0, 1]]
    assert result.emitted == [[6, 8, 2], [3, 0]]


# ---- verify_sampling: the walk -----------------------------------------------------------


def one_hot(rows: list[int], vocab: int = 16) -> torch.Tensor:
    return torch.nn.functional.one_hot(t(rows), vocab).float()


def repeat(trees: DraftTrees, count: int) -> DraftTrees:
    """`count` copies of a one-request batch (views, no copies)."""
    return DraftTrees(
        tokens=trees.tokens.expand(count, -1),
        parents=trees.parents.expand(count, -1),
        depths=trees.depths.expand(count, -1),
        mask=trees.mask.expand(count, -1, -1),
        next_token=trees.next_token.expand(count, -1),
        next_sibling=trees.next_sibling.expand(count, -1),
        num_nodes=trees.num_nodes * count,
    )


def test_sampling_with_one_hot_targets_accepts_what_greedy_accepts() -> None:
    target = [[6, 8, 1, 2, 3, 0], [7, 9, 11, 1, 1, 0], [4, 8, 1, 1, 1, 0]]
    trees = trees_from_parents([5] * 3, [[6, 7, 8, 9]] * 3, [[0, 0, 1, 1]] * 3, n=6)
    probs = torch.stack([one_hot(row) for row in target])
    sampled = verify_sampling(trees, probs, generator=torch.Generator().manual_seed(0))
    greedy = verify_greedy(trees, t(target))
    assert sampled == greedy
    assert sampled.accepted == [[0, 1, 3], [0, 2], [0]]


def test_sampling_never_accepts_the_second_copy_of_a_duplicate_sibling() -> None:
    trees = trees_from_parents([5], [[6, 6, 7]], [[0, 0, 0]], n=4)
    probs = torch.full((4000, 4, 8), 1 / 8)
    result = verify_sampling(repeat(trees, 4000), probs, torch.Generator().manual_seed(0))
    assert {tuple(a) for a in result.accepted} == {(0,), (0, 1), (0, 3)}


def test_a_seeded_request_gets_the_same_result_in_any_batch() -> None:
    trees = trees_from_parents([5] * 3, [[6, 7, 8, 9]] * 3, [[0, 0, 1, 1]] * 3, n=6)
    probs = torch.full((3, 6, 16), 1 / 16)
    single = trees_from_parents([5], [[6, 7, 8, 9]], [[0, 0, 1, 1]], n=6)
    alone = [
        verify_sampling(single, probs[:1], generators=[torch.Generator().manual_seed(seed)])
        for seed in range(20)
    ]
    for seed in range(20):
        in_batch = verify_sampling(
            trees,
            probs,
            generator=torch.Generator().manual_seed(1000 + seed),
            generators=[None, torch.Generator().manual_seed(seed), None],
        )
        assert in_batch.accepted[1] == alone[seed].accepted[0]
        assert in_batch.emitted[1] == alone[seed].emitted[0]
    assert len({tuple(r.emitted[0]) for r in alone}) > 1  # the seed matters


def test_sampling_rejects_a_reached_row_without_mass() -> None:
    probs = torch.zeros((1, 6, 16))
    with pytest.raises(ValueError, match="without mass"):
        verify_sampling(TREE, probs)


def test_sampling_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"probs must be \[B, n, V\]"):
        verify_sampling(TREE, torch.ones((1, 5, 16)))
    with pytest.raises(ValueError, match="one entry per request"):
        verify_sampling(TREE, torch.ones((1, 6, 16)), generators=[None, None])


# ---- verify_sampling: the emitted tokens follow the target (chi-square) -------------------

TRIALS = 100_000
VOCAB = 12
MIN_SAMPLES = 1_000  # test the token after a node once it was accepted this often


def chi2_critical(df: int, p: float = 0.001) -> float:
    """Upper critical value of chi-square by the Wilson-Hilferty approximation (slightly
    conservative for df = 1: 11.2 instead of 10.8)."""
    z = NormalDist().inv_cdf(1 - p)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(samples: list[int], probs: torch.Tensor, what: str) -> None:
    """Chi-square test of `samples` against `probs` [V] at p = 0.001; cells expected fewer
    than 5 times are merged, tokens without mass must never appear."""
    counts = torch.bincount(t(samples), minlength=probs.shape[0]).double()
    total = len(samples)
    assert counts[probs == 0].sum() == 0, f"{what}: sampled a token without target mass"
    expected = probs.double()[probs > 0] * total
    observed = counts[probs > 0]
    order = expected.argsort()
    cells: list[tuple[float, float]] = []
    pending_e, pending_o = 0.0, 0.0
    for i in order.tolist():
        pending_e += expected[i].item()
        pending_o += observed[i].item()
        if pending_e >= 5:
            cells.append((pending_e, pending_o))
            pending_e, pending_o = 0.0, 0.0
    if pending_e > 0 and cells:
        e, o = cells.pop()
        cells.append((e + pending_e, o + pending_o))
    if len(cells) < 2:
        return
    stat = sum((o - e) ** 2 / e for e, o in cells)
    critical = chi2_critical(len(cells) - 1)
    assert stat < critical, f"{what}: chi2 {stat:.1f} >= {critical:.1f} ({len(cells)} cells)"


def random_tree(gen: torch.Generator, depth: int) -> DraftTrees:
    """A full tree of the given depth, 2 or 3 children per node with distinct tokens."""
    node_tokens: list[int] = []
    node_parents: list[int] = []
    level = [0]
    for _ in range(depth):
        below = []
        for parent in level:
            width = int(torch.randint(2, 4, (), generator=gen))
            for token in torch.randperm(VOCAB, generator=gen)[:width].tolist():
                node_tokens.append(token)
                node_parents.append(parent)
                below.append(len(node_tokens))
        level = below
    root = int(torch.randint(VOCAB, (), generator=gen))
    return trees_from_parents([root], [node_tokens], [node_parents], len(node_tokens) + 1)


def dirichlet(gen: torch.Generator, rows: int) -> torch.Tensor:
    """Rows drawn from Dirichlet(1, ..., 1): normalised exponentials."""
    weights = -torch.log(torch.rand((rows, VOCAB), generator=gen, dtype=torch.float64))
    return (weights / weights.sum(dim=-1, keepdim=True)).float()


def children_tokens(trees: DraftTrees, node: int) -> list[int]:
    return [
        trees.tokens[0, c].item()
        for c in chain(trees.next_token[0].tolist(), trees.next_sibling[0].tolist(), node)
    ]


def target_probs(case: str, trees: DraftTrees, gen: torch.Generator) -> torch.Tensor:
    n = trees.num_draft_tokens
    probs = dirichlet(gen, n)
    if case == "one_hot_on_a_child":
        for node in range(n):
            kids = children_tokens(trees, node)
            if kids:
                probs[node] = one_hot([kids[-1]], VOCAB)[0]
    elif case == "no_mass_on_any_child":
        for node in range(n):
            probs[node, children_tokens(trees, node)] = 0
    elif case == "top_k_with_zeros":
        probs[probs < probs.topk(3, dim=-1).values[:, -1:]] = 0
    return probs / probs.sum(dim=-1, keepdim=True)


CASES = [
    ("dirichlet", 2, 0),
    ("dirichlet", 3, 1),
    ("dirichlet", 3, 2),
    ("one_hot_on_a_child", 3, 3),
    ("no_mass_on_any_child", 2, 4),
    ("top_k_with_zeros", 3, 5),
]


@pytest.mark.parametrize(("case", "depth", "seed"), CASES)
def test_every_emitted_token_follows_the_target_after_its_accepted_prefix(
    case: str, depth: int, seed: int
) -> None:
    """The first emitted token follows probs[root]; given that the walk accepted node c (its
    path was emitted), the next emitted token follows probs[c]. Together: the emitted tokens
    follow the target's chain distribution P(t1, t2, ...) = p_root(t1) p_{t1}(t2) ..."""
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen, depth)
    probs = target_probs(case, tree, gen)
    result = verify_sampling(
        repeat(tree, TRIALS),
        probs.expand(TRIALS, -1, -1),
        generator=torch.Generator().manual_seed(100 + seed),
    )
    after: dict[int, list[int]] = {}
    for nodes, tokens in zip(result.accepted, result.emitted):
        assert len(tokens) == len(nodes)
        for i, node in enumerate(nodes):
            after.setdefault(node, []).append(tokens[i])
    assert len(after[0]) == TRIALS
    tested = [node for node, samples in after.items() if len(samples) >= MIN_SAMPLES]
    if case != "no_mass_on_any_child":
        assert len(tested) > 1, "no child was accepted often enough to test"
    for node in tested:
        assert_follows(after[node], probs[node], f"after node {node}")
    if case == "one_hot_on_a_child":
        assert all(len(nodes) == depth + 1 for nodes in result.accepted)
    if case == "no_mass_on_any_child":
        assert set(after) == {0}


def test_duplicate_sibling_tokens_keep_the_first_token_lossless() -> None:
    trees = trees_from_parents([1], [[3, 3, 5, 3]], [[0, 0, 0, 0]], n=5)
    probs = dirichlet(torch.Generator().manual_seed(7), 5)
    result = verify_sampling(
        repeat(trees, TRIALS), probs.expand(TRIALS, -1, -1), torch.Generator().manual_seed(8)
    )
    assert_follows([e[0] for e in result.emitted], probs[0], "first token")
    assert {a[1] for a in result.accepted if len(a) > 1} == {1, 3}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.integers(0, 4),
    st.integers(0, 2**31),
)
def test_greedy_acceptance_on_the_device_walks_as_the_host_does(
    tokens: list[int], parent_draws: list[int], padding: int, seed: int
) -> None:
    """accept_greedy_on_device against verify_greedy's walk: any tree (siblings with equal
    tokens included: the first in node order wins), padding nodes, targets that often match."""
    parents = [draw % (i + 1) for i, draw in enumerate(parent_draws[: len(tokens)])]
    tokens = tokens[: len(parents)]
    n = len(tokens) + 1 + padding
    trees = trees_from_parents([7, 1], [tokens, tokens[::-1]], [parents, [0] * len(tokens)], n)
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 4, (2, n), generator=gen)
    expected = verify_greedy(trees, target)
    got = unpack_accepted(accept_greedy_on_device(trees, target).tolist())
    assert got.accepted == expected.accepted and got.emitted == expected.emitted
