"""NgramDrafter: which tree it proposes from the context and the corpus, and its limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.speculative.sources.ngram import NgramDrafter, NgramState


def test_a_repeated_phrase_is_proposed_as_a_chain():
    drafter = NgramDrafter(max_nodes=8, max_depth=4)
    assert drafter.propose([5, 6, 7, 8, 9, 5, 6]) == ([7, 8, 9, 5], [0, 1, 2, 3])


def test_the_chain_is_cut_at_max_nodes_and_max_depth():
    context = [5, 6, 7, 8, 9, 5, 6]
    assert NgramDrafter(max_nodes=2, max_depth=4).propose(context) == ([7, 8], [0, 1])
    assert NgramDrafter(max_nodes=8, max_depth=3).propose(context) == ([7, 8, 9], [0, 1, 2])


def test_two_continuations_become_siblings_ranked_by_frequency():
    # "1 2" is followed by 3 twice and by 4 once; longer suffixes match nothing.
    context = [7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2, 3, 6, 1, 2]
    drafter = NgramDrafter(max_nodes=4, max_depth=1)
    assert drafter.propose(context) == ([3, 4], [0, 0])


def test_equally_frequent_siblings_rank_the_most_recent_first():
    context = [7, 1, 2, 3, 8, 1, 2, 4, 6, 1, 2]
    assert NgramDrafter(max_nodes=4, max_depth=1).propose(context) == ([4, 3], [0, 0])


def test_a_tree_expands_the_most_probable_paths_first():
    # Continuations of "0 1 2": [3, 5], [3, 5], [4, 9], [3, 6]; path probabilities 3: 3/4,
    # 3->5: 1/2, then 1/4 for 3->6 (the most recent), 4 and 4->9 (a child of 4, so after it).
    context = [0, 1, 2, 3, 5, 0, 1, 2, 3, 5, 0, 1, 2, 4, 9, 0, 1, 2, 3, 6, 0, 1, 2]
    drafter = NgramDrafter(max_nodes=4, max_depth=2)
    assert drafter.propose(context) == ([3, 5, 6, 4], [0, 1, 1, 0])


def test_the_longest_matched_suffix_wins_over_a_more_frequent_shorter_one():
    # "1 2 3" was followed by 7 once; "2 3" by 9 once more; "3" alone was followed by 8 twice.
    context = [2, 3, 9, 1, 2, 3, 7, 5, 3, 8, 4, 3, 8, 1, 2, 3]
    assert NgramDrafter(max_nodes=1, max_depth=1).propose(context) == ([7], [0])
    # a two-token match joins the tree; one-token matches only where nothing longer matched
    assert NgramDrafter(max_nodes=3, max_depth=1).propose(context) == ([7, 9], [0, 0])
    # one-token matches beside longer ones, too
    drafter = NgramDrafter(max_nodes=3, max_depth=1, shortest_alone=0)
    assert drafter.propose(context) == ([7, 9, 8], [0, 0, 0])


def test_one_token_matches_draft_where_nothing_longer_matches():
    context = [5, 3, 8, 4, 3, 8, 1, 3]  # "1 3" never came before; "3" was followed by 8 twice
    state = NgramState()
    # "3 8 4" and "3 8 1": 8 twice, then the newer continuation first
    assert NgramDrafter(max_nodes=2, max_depth=2).propose(context, state) == ([8, 1], [0, 1])
    assert state.match_len == 1


def test_min_ngram_ignores_shorter_matches():
    context = [1, 2, 3, 7, 5, 3, 8, 4, 3, 8, 1, 2, 3]
    drafter = NgramDrafter(max_nodes=4, max_depth=1, min_ngram=2)
    assert drafter.propose(context) == ([7], [0])


def test_the_corpus_is_matched_when_the_context_has_no_earlier_occurrence():
    drafter = NgramDrafter(max_nodes=8, max_depth=4)
    drafter.add_sequence([10, 11, 12, 13, 14])
    assert drafter.propose([1, 2, 10, 11]) == ([12, 13, 14], [0, 1, 2])


def test_a_longer_corpus_match_beats_a_shorter_self_match():
    drafter = NgramDrafter(max_nodes=1, max_depth=1)
    drafter.add_sequence([4, 5, 6, 20])
    assert drafter.propose([6, 30, 4, 5, 6]) == ([20], [0])


def test_no_match_gives_an_empty_tree():
    drafter = NgramDrafter(max_nodes=8, max_depth=4)
    drafter.add_sequence([10, 11, 12])
    assert drafter.propose([1, 2, 3]) == ([], [])
    assert drafter.propose([]) == ([], [])
    assert NgramDrafter(max_nodes=0, max_depth=4).propose([1, 1, 1]) == ([], [])


def test_the_index_cap_evicts_the_oldest_sequences():
    drafter = NgramDrafter(max_nodes=8, max_depth=4, max_indexed_tokens=10)
    drafter.add_sequence([1, 2, 3, 4, 5])
    drafter.add_sequence([6, 7, 8, 9, 10])
    assert drafter.num_indexed_tokens == 10
    drafter.add_sequence([11, 12, 13])
    assert drafter.num_indexed_tokens == 8
    assert drafter.propose([1, 2]) == ([], [])
    assert drafter.propose([6, 7]) == ([8, 9, 10], [0, 1, 2])
    assert drafter.propose([11, 12]) == ([13], [0])


def test_a_sequence_longer_than_the_cap_keeps_its_tail():
    drafter = NgramDrafter(max_nodes=8, max_depth=4, max_indexed_tokens=3)
    drafter.add_sequence([1, 2, 3, 4, 5])
    assert drafter.num_indexed_tokens == 3
    assert drafter.propose([1, 2]) == ([], [])
    assert drafter.propose([3]) == ([4, 5], [0, 1])


def test_eviction_leaves_the_other_sequences_occurrences_of_shared_ngrams():
    drafter = NgramDrafter(max_nodes=8, max_depth=1, max_indexed_tokens=6)
    drafter.add_sequence([1, 2, 3])
    drafter.add_sequence([1, 2, 4])
    drafter.add_sequence([9, 9, 9])
    assert drafter.propose([1, 2]) == ([4], [0])


def test_invalid_limits_are_rejected_with_the_offending_value():
    with pytest.raises(ValueError, match="max_depth must be >= 1 \\(got 0\\)"):
        NgramDrafter(max_nodes=4, max_depth=0)
    with pytest.raises(ValueError, match="min_ngram=3, max_ngram=2"):
        NgramDrafter(max_nodes=4, max_depth=2, min_ngram=3, max_ngram=2)


def test_a_state_from_another_context_is_reset():
    drafter = NgramDrafter(max_nodes=8, max_depth=4)
    state = NgramState()
    drafter.propose([1, 2, 3, 1, 2, 3, 1], state)
    assert drafter.propose([5, 6, 5], state) == ([6, 5], [0, 1])


tokens = st.lists(st.integers(0, 3), max_size=60)


@settings(max_examples=200, deadline=None)
@given(
    context=tokens,
    corpus=st.lists(tokens, max_size=3),
    max_nodes=st.integers(0, 12),
    max_depth=st.integers(1, 5),
    min_ngram=st.integers(1, 3),
    extra_ngram=st.integers(0, 2),
)
def test_trees_respect_the_limits_and_follow_real_continuations(
    context, corpus, max_nodes, max_depth, min_ngram, extra_ngram
):
    drafter = NgramDrafter(max_nodes, max_depth, min_ngram, min_ngram + extra_ngram, 50)
    for seq in corpus:
        drafter.add_sequence(seq)
    node_tokens, parents = drafter.propose(context)
    assert len(node_tokens) == len(parents) <= max_nodes
    assert all(0 <= p <= i for i, p in enumerate(parents))
    assert len(set(zip(parents, node_tokens))) == len(node_tokens)
    paths: list[list[int]] = [context[-1:]]
    for token, parent in zip(node_tokens, parents):
        paths.append(paths[parent] + [token])
    texts = [context, *corpus]
    for path in paths[1:]:
        assert len(path) - 1 <= max_depth
        assert any(_contains(text, path) for text in texts)


@settings(max_examples=100, deadline=None)
@given(context=tokens, corpus=tokens, steps=st.lists(st.integers(1, 4), min_size=1))
def test_an_incremental_state_proposes_what_a_fresh_one_does(context, corpus, steps):
    drafter = NgramDrafter(max_nodes=6, max_depth=3)
    drafter.add_sequence(corpus)
    state = NgramState()
    length = 0
    for step in steps:
        length = min(len(context), length + step)
        prefix = context[:length]
        assert drafter.propose(prefix, state) == drafter.propose(prefix)


@settings(max_examples=100, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=15), max_size=8),
    contexts=st.lists(tokens, min_size=1, max_size=4),
)
def test_after_evictions_the_corpus_matches_as_if_only_the_newest_that_fit_were_added(
    seqs, contexts
):
    cap = 20
    drafter = NgramDrafter(max_nodes=6, max_depth=3, max_indexed_tokens=cap)
    for seq in seqs:
        drafter.add_sequence(seq)
    kept: list[list[int]] = []
    for seq in reversed([seq[-cap:] for seq in seqs if len(seq) > 1]):
        if sum(map(len, kept)) + len(seq) > cap:
            break
        kept.insert(0, seq)
    fresh = NgramDrafter(max_nodes=6, max_depth=3)
    for seq in kept:
        fresh.add_sequence(seq)
    assert drafter.num_indexed_tokens == sum(map(len, kept))
    for context in contexts:
        assert drafter.propose(context) == fresh.propose(context)


def _contains(text: list[int], part: list[int]) -> bool:
    return any(text[i : i + len(part)] == part for i in range(len(text) - len(part) + 1))
