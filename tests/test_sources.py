"""Every source at once: Medusa heads in the worker, beside the scheduler's n-gram index and
LOOKAHEAD's window and pool (and a grammar's forced text), with the planner choosing each
request's tree each round. Greedy output identical to plain decoding (float32) at batch 1 and 8
and under grammars, both kinds of tree chosen in one run, a chi-squared test of sampled output
against plain sampling with a control that bypasses verification and fails it, and the flag's
refusal without n-gram trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from spectral.args import ServerArgs
from spectral.speculative.sources.acceptance import HEAD, NGRAM, family
from tests.test_medusa import (
    check_heads_sampling,
    check_small_vocab_greedy,
    medusa,
    random_heads,
    small_vocab_model_dir,
)
from tests.test_speculative import plain_outputs, prompts, run
from tests.test_standalone import check_grammars_keep_greedy_output

__all__ = ["plain_outputs", "small_vocab_model_dir"]  # fixtures shared with other tests

CASES = {"batch1": dict(at_once=1), "batch8": dict(at_once=8)}


def every_source(model_dir: str, heads: str, **options):
    return medusa(
        model_dir, heads, speculative_hybrid_ngram=6, speculative_hybrid_lookahead=True, **options
    )


def kinds_planned(s) -> set[str]:
    """The families of tree the planner's rounds verified (HEAD: the worker's drafter)."""
    stats = s.spec_round.planner.stats
    return {family(kind) for kind, st in stats.items() if st.seen}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_decoding_with_every_source(
    case: str, small_vocab_model_dir: str, tmp_path: Path
) -> None:
    """On the 16-token model, where the heads, the n-gram index and the pool all draft
    tokens that are accepted: the planner gives requests trees of both kinds."""
    heads = random_heads(small_vocab_model_dir, tmp_path / "heads", seed=1)
    made = []

    def make(**options):
        made.append(every_source(small_vocab_model_dir, heads, **options))
        return made[-1]

    check_small_vocab_greedy(small_vocab_model_dir, make, CASES[case])
    assert kinds_planned(made[0]) == {HEAD, NGRAM}


def test_grammars_keep_greedy_output_equal(
    peaky_model_dir: str, tmp_path: Path, plain_outputs: list[list[int]]
) -> None:
    heads = random_heads(peaky_model_dir, tmp_path / "heads")
    s = every_source(peaky_model_dir, heads)
    # Prompts seen before: the n-gram index matches their answers.
    seen = run(s, prompts(20)[:4], temperature=0.0)
    assert [r.output_ids for r in seen] == plain_outputs[:4]
    check_grammars_keep_greedy_output(peaky_model_dir, s)


def test_sampled_output_follows_plain_sampling_and_a_control_without_verification_fails(
    small_vocab_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_heads_sampling(small_vocab_model_dir, tmp_path, monkeypatch, every_source)


def test_the_pool_beside_a_drafter_needs_ngram_trees() -> None:
    with pytest.raises(ValueError, match="--speculative-hybrid-ngram >= 2"):
        ServerArgs(
            speculative_algorithm="EAGLE3",
            speculative_hybrid_ngram=0,
            speculative_hybrid_lookahead=True,
        )
