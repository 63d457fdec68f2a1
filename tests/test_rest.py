"""REST: drafts retrieved from a datastore (--speculative-datastore), alone and beside NGRAM and
EAGLE3's n-gram trees. Oracles: plain decoding (float32 greedy, token for token) and plain
sampling (chi-squared, with a control that accepts drafts without verifying them)."""

from __future__ import annotations

import functools
import random

import pytest
from transformers import AutoTokenizer

from spectral.args import ServerArgs
from spectral.speculative.sources.datastore import tokenizer_fingerprint, write
from tests.conftest import scheduler_leaks
from tests.test_lookahead import last_tokens
from tests.test_medusa import check_small_vocab_greedy, small_vocab_model_dir
from tests.test_speculative import eagle3_head, make_spec_scheduler, plain_outputs, prompts, run
from tests.test_standalone import accepted_per_round, check_sampling_and_control

__all__ = ["eagle3_head", "plain_outputs", "small_vocab_model_dir"]  # fixtures used here


def make_store(path, model_dir: str, docs: list[list[int]]) -> str:
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_dir))
    write(path, docs, {"tokenizer": fingerprint, "model": model_dir})
    return str(path)


@pytest.fixture(scope="module")
def store(tmp_path_factory, peaky_model_dir: str, plain_outputs: list[list[int]]) -> str:
    """Half the test prompts with their plain answers (drafts that are accepted), and each
    prompt again with a random answer (drafts that are not)."""
    rng = random.Random(3)
    batch = prompts(20)
    docs = [p + out for p, out in zip(batch[::2], plain_outputs[::2])]
    docs += [p + [rng.randrange(3, 5000) for _ in range(12)] for p in batch]
    return make_store(tmp_path_factory.mktemp("rest"), peaky_model_dir, docs)


CASES = {
    "rest-batch1": dict(speculative_algorithm="REST", at_once=1),
    "rest-batch8": dict(speculative_algorithm="REST", at_once=8),
    "ngram-rest-batch8": dict(speculative_algorithm="NGRAM", at_once=8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_decoding(
    case: str, peaky_model_dir: str, store: str, plain_outputs: list[list[int]]
) -> None:
    options = dict(CASES[case])
    at_once = options.pop("at_once")
    s = make_spec_scheduler(peaky_model_dir, speculative_datastore=store, **options)
    count = 8 if at_once == 1 else 20
    reqs = run(s, prompts(20)[:count], at_once=at_once, temperature=0.0)
    assert [r.output_ids for r in reqs] == plain_outputs[:count]
    assert accepted_per_round(s) > 0.5  # the datastore's answers were drafted and accepted
    assert not scheduler_leaks(s)
    held = s.info()["caches"]["datastore"]
    assert held["path"] == store and held["tokens"] > 0
    assert 0 < held["resident_bytes"] < held["bytes"]  # the index alone is held


def test_beside_eagle3_the_datastore_joins_its_ngram_trees_and_output_equals_plain(
    peaky_model_dir: str, eagle3_head: str, store: str, plain_outputs: list[list[int]]
) -> None:
    s = make_spec_scheduler(
        peaky_model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=eagle3_head,
        speculative_datastore=store,
    )
    reqs = run(s, prompts(20), at_once=8, temperature=0.0)
    assert [r.output_ids for r in reqs] == plain_outputs
    # rounds whose tree came from the datastore alone count in statistics of their own
    assert any(kind.startswith("rest:") for kind in s.spec_round.planner.stats)
    assert not scheduler_leaks(s)


def test_small_vocab_greedy_with_drafts_accepted(small_vocab_model_dir: str, tmp_path) -> None:
    """On the 16-token model the datastore holds the model's own greedy answers to other
    prompts: long matches, most drafts right."""
    model = small_vocab_model_dir
    batch = [[t % 16 for t in p] for p in prompts(12, seed=9)]
    answers = run(make_spec_scheduler(model), batch, max_new_tokens=40, temperature=0.0)
    docs = [p + r.output_ids for p, r in zip(batch, answers)]
    store = make_store(tmp_path / "ds", model, docs)
    make = functools.partial(
        make_spec_scheduler, model, speculative_algorithm="REST", speculative_datastore=store
    )
    check_small_vocab_greedy(model, make, dict(at_once=4))


def test_sampled_output_follows_plain_sampling_and_a_control_without_verification_fails(
    small_vocab_model_dir: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = small_vocab_model_dir
    prompt = [5, 9, 3, 12, 7, 4]
    plain_scheduler = make_spec_scheduler(model, max_running_requests=64)
    plain = last_tokens(plain_scheduler, prompt, 300)
    # the datastore: plain samples of the same prompt (what follows it, as the model samples)
    samples = run(plain_scheduler, [prompt] * 64, max_new_tokens=12, temperature=1.0, top_k=3)
    store = make_store(tmp_path / "ds", model, [prompt + r.output_ids for r in samples])
    make = functools.partial(
        make_spec_scheduler,
        model,
        speculative_algorithm="REST",
        speculative_datastore=store,
        speculative_fixed_tree=True,
        speculative_max_batch_size=64,
        max_running_requests=64,
    )
    check_sampling_and_control(
        monkeypatch, plain, make, lambda s: last_tokens(s, prompt, 300), accepted=0.3
    )


def test_a_datastore_of_another_tokenizer_is_refused_naming_both(
    peaky_model_dir: str, tmp_path
) -> None:
    write(tmp_path, [[5, 6, 7]], {"tokenizer": "0" * 32, "model": "some-other-model"})
    with pytest.raises(ValueError, match="another tokenizer .*some-other-model"):
        make_spec_scheduler(
            peaky_model_dir, speculative_algorithm="REST", speculative_datastore=str(tmp_path)
        )


def test_rest_settings_are_checked_naming_the_flag(tmp_path) -> None:
    with pytest.raises(
        ValueError, match="REST drafts from a datastore: give --speculative-datastore"
    ):
        ServerArgs(speculative_algorithm="REST")
    with pytest.raises(ValueError, match="it needs --speculative-hybrid-ngram >= 2"):
        ServerArgs(
            speculative_algorithm="EAGLE3",
            speculative_hybrid_ngram=0,
            speculative_datastore=str(tmp_path),
        )
    # a datastore alone drafts by itself
    assert ServerArgs(speculative_datastore=str(tmp_path)).spec.algorithm == "REST"
