"""LOOKAHEAD (Jacobi decoding with an n-gram pool) in the scheduler: greedy output identical
token for token to plain decoding (float32) at batch 1 and 8, with and without grammars, nothing
leaked; a chi-squared test of sampled output against plain sampling, with a control that
bypasses verification and fails it; the window and pool against a hand-worked round."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

from spectral.speculative.sources.lookahead import LookaheadDrafter, LookaheadState
from tests.test_medusa import check_small_vocab_greedy, small_vocab_model_dir
from tests.test_speculative import make_spec_scheduler, plain_outputs, run
from tests.test_standalone import (
    check_grammars_keep_greedy_output,
    check_greedy_case,
    check_sampling_and_control,
)

__all__ = ["plain_outputs", "small_vocab_model_dir"]  # fixtures shared with other tests

CASES = {
    "window4-batch1": dict(
        speculative_lookahead_window=4,
        speculative_lookahead_ngram=3,
        speculative_lookahead_guesses=2,
        at_once=1,
    ),
    "window2-batch8": dict(
        speculative_lookahead_window=2,
        speculative_lookahead_ngram=2,
        speculative_lookahead_guesses=3,
        at_once=8,
    ),
}


def lookahead(model_dir: str, **options):
    return make_spec_scheduler(model_dir, speculative_algorithm="LOOKAHEAD", **options)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_decoding(
    case: str, peaky_model_dir: str, plain_outputs: list[list[int]]
) -> None:
    make = functools.partial(lookahead, peaky_model_dir, speculative_fixed_tree=True)
    check_greedy_case(make, CASES[case], plain_outputs)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_decoding_where_guesses_are_accepted(
    case: str, small_vocab_model_dir: str
) -> None:
    make = functools.partial(lookahead, small_vocab_model_dir)
    check_small_vocab_greedy(small_vocab_model_dir, make, CASES[case])


def test_grammars_keep_greedy_output_equal(peaky_model_dir: str) -> None:
    s = lookahead(peaky_model_dir, speculative_fixed_tree=True)
    check_grammars_keep_greedy_output(peaky_model_dir, s)


def test_sampled_output_follows_plain_sampling_and_a_control_without_verification_fails(
    small_vocab_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = small_vocab_model_dir
    prompt = [5, 9, 3, 12, 7, 4]
    plain = last_tokens(make_spec_scheduler(model, max_running_requests=64), prompt, 300)
    make = functools.partial(
        lookahead,
        model,
        speculative_lookahead_window=3,
        speculative_lookahead_guesses=3,
        speculative_fixed_tree=True,
        speculative_max_batch_size=64,
        max_running_requests=64,
    )
    check_sampling_and_control(
        monkeypatch, plain, make, lambda s: last_tokens(s, prompt, 300), accepted=0.08
    )


def last_tokens(s, prompt: list[int], n: int) -> Counter:
    """The 8th token of `n` samples: rounds before it have filled the window and the pool."""
    reqs = run(s, [prompt] * n, max_new_tokens=8, temperature=1.0, top_k=3, ignore_eos=True)
    return Counter(r.output_ids[-1] for r in reqs)


def test_a_round_moves_the_window_and_fills_the_pool_as_worked_by_hand() -> None:
    drafter = LookaheadDrafter(window=3, ngram=3, guesses=2)
    state = LookaheadState()
    # a new request guesses its own last tokens; the pool is empty: the tree is the chain
    tokens, parents = drafter.propose([7, 1, 2, 3], state)
    assert (tokens, parents, state.chain_nodes) == ([1, 2, 3], [0, 1, 2], [0, 1, 2])
    # the target chose 1 after the root 3 (so guess 1 is right), 9 after 1, 4 after 2, 5 after 3:
    # the round emitted 1 and 9 (2 tokens)
    drafter.observe(state, [1, 9, 4, 5], verified=3, accepted=2)
    # 3-grams along the chain, each ending in the target's choice: (3, 1, 9), (1, 2, 4),
    # (2, 3, 5); the window: the choices after chain nodes 2 and 3 guess the positions after
    # the new root, topped up from the old window
    assert {k: list(v) for k, v in state.pool.items()} == {3: [(1, 9)], 1: [(2, 4)], 2: [(3, 5)]}
    assert state.window == [4, 5, 3]
    # the next root is 9: no pool entry; the root 1 would verify the pool's (2, 4) first
    tokens, parents = drafter.propose([7, 1, 2, 3, 1, 9], state)
    assert (tokens, parents) == ([4, 5, 3], [0, 1, 2])
    tokens, parents = drafter.propose([5, 1], state)
    assert (tokens, parents, state.chain_nodes) == ([2, 4, 4, 5, 3], [0, 1, 0, 3, 4], [2, 3, 4])
