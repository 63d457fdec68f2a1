"""STANDALONE speculation (a draft LM with the target's tokenizer) in the scheduler: greedy output
identical token for token to plain decoding (float32), at batch 1 and 8, under grammars, with
radix hits, chunked prefill, retraction and aborts, nothing leaked; a chi-squared test of
sampled output against plain sampling, with a control that bypasses verification and fails it;
a draft identical to the target accepted nearly always (its KV bookkeeping is right); a draft
with another tokenizer refused; a hot-token map drafting only its tokens."""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import spectral.worker.spec_verify as spec_verify
from spectral.args import ServerArgs
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.req import Req
from spectral.models.resolved import resolve_model
from spectral.sampling_params import SamplingParams
from spectral.scheduler.scheduler import MIN_NEW_TOKEN_RATIO
from spectral.speculative.drafters.draft_model import DraftModelDrafter, as_chains
from spectral.speculative.verify import verify_greedy
from spectral.worker.factory import create_worker
from tests.conftest import make_tiny_model, scheduler_leaks
from tests.test_spec_tree import chi2_critical
from tests.test_speculative import make_spec_scheduler, plain_outputs, prompts, run
from tests.test_structured_spec import two_sample_chi2

__all__ = ["plain_outputs"]  # the fixture, shared with tests/test_speculative.py


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> str:
    """A one-layer draft LM, narrower than the target, its vocabulary padded past the
    tokenizer's (as a GGUF's often is)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("draft-llama"),
        default_model_dir,
        seed=3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=49216,
        initializer_range=1.0,
        max_position_embeddings=2048,
    )


def standalone(model_dir: str, draft: str, **options):
    return make_spec_scheduler(
        model_dir,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=draft,
        **options,
    )


CASES = {
    "chain-batch1": dict(
        speculative_eagle_topk=1,
        speculative_num_steps=4,
        speculative_num_draft_tokens=5,
        at_once=1,
    ),
    "tree-batch8": dict(  # the draft's layers quantized to 4 bits (it only proposes)
        speculative_draft_quantization="q4_1",
        speculative_eagle_topk=3,
        speculative_num_steps=3,
        speculative_num_draft_tokens=8,
        at_once=8,
    ),
}


def check_greedy_case(make, case: dict, plain_outputs: list[list[int]]):
    """The scheduler `make(**options)` builds for `case` (its options and `at_once`, the
    requests in flight) gives plain decoding's greedy output on the test prompts, every request
    through rounds; returns the scheduler."""
    opts = dict(case)
    at_once = opts.pop("at_once")
    s = make(**opts)
    count = 8 if at_once == 1 else 20
    reqs = run(s, prompts(20)[:count], at_once=at_once, temperature=0.0)
    assert [r.output_ids for r in reqs] == plain_outputs[:count]
    assert all(r.spec.verify_ct > 0 for r in reqs)
    return s


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_decoding(
    case: str, peaky_model_dir: str, draft_dir: str, plain_outputs: list[list[int]]
) -> None:
    check_greedy_case(
        functools.partial(standalone, peaky_model_dir, draft_dir), CASES[case], plain_outputs
    )


def test_the_draft_models_levels_through_static_buffers_keep_output_equal(
    peaky_model_dir: str, draft_dir: str, plain_outputs: list[list[int]]
) -> None:
    """With --cuda-graph-bs 1 2 4 8, a tree level (a decode step of the draft over k rows a
    request) runs through the draft worker's graph runner, padded to 3, 6, 12 or 24 rows (CUDA
    graphs on a GPU, the same static buffers eagerly here), and so does a catch-up of up to
    num_steps + 1 tokens a request (verification buckets of chains): plain decoding's
    output."""
    runs = []

    def make(**options):
        s = standalone(peaky_model_dir, draft_dir, **options)
        runner = s.worker.drafter.lm.graphs
        run_bucket = runner.run
        runner.run = lambda batch, bucket: runs.append(bucket) or run_bucket(batch, bucket)
        return s

    s = check_greedy_case(
        make, CASES["tree-batch8"] | {"cuda_graph_bs": [1, 2, 4, 8]}, plain_outputs
    )
    info = s.worker.draft_graphs  # levels of 1-8 requests' k rows, catch-ups of 1-8 requests
    assert info["decode_batch_sizes"] == [1, 2, 3, 4, 6, 8, 12, 24]
    assert info["verify_tree_sizes"][-1] == s.worker.drafter.catch_up_width == 4
    decode_sizes = {bucket.requests for bucket in runs if bucket.tokens == 1}
    levels, catch_ups = decode_sizes & {3, 6, 12, 24}, decode_sizes & {1, 2, 4, 8}
    assert 24 in levels and len(levels) > 1, levels
    # a catch-up of each request's root alone is a decode step of 8 requests, fewer later
    assert 8 in catch_ups and len(catch_ups) > 1, catch_ups


def test_a_catch_up_is_verified_as_chains():
    """Catch-ups of 2 and 3 tokens: one causal mask a request, every row's logits; of one
    token a request: a decode step."""
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.arange(5),
        positions=torch.tensor([4, 5, 7, 8, 9]),
        out_cache_loc=torch.arange(10, 15),
        req_pool_indices=torch.tensor([0, 3]),
        prefix_lens=[4, 7],
        extend_lens=[2, 3],
    )
    chains = as_chains(batch)
    assert chains.mode == ForwardMode.TARGET_VERIFY and chains.logits_rows == "all"
    expected = [[1, 0], [1, 1]], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert chains.custom_mask.tolist() == [bool(x) for m in expected for row in m for x in row]
    assert torch.equal(chains.positions, batch.positions) and chains.prefix_lens == [4, 7]
    roots = dataclasses.replace(batch, extend_lens=[1, 1], input_ids=torch.arange(2))
    assert as_chains(roots).mode == ForwardMode.DECODE and as_chains(roots).custom_mask is None


def accepted_per_round(s) -> float:
    stats = s.stats
    return (stats.spec_emitted_tokens - stats.spec_verify_ct) / stats.spec_verify_ct


def test_a_draft_equal_to_the_target_is_accepted_nearly_always(
    peaky_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target as its own draft: its chains agree with the target unless the draft's KV is
    wrong somewhere (a position not caught up, a scratch row with the wrong ancestors, a
    cached prefix's KV missing, a level's KV copied to the wrong slot); prompts share prefixes
    (radix hits) and prefill in chunks. The accepted tokens a level computed are not computed
    again: a catch-up runs over the last accepted token and the root at most."""
    caught_up: list[int] = []  # tokens a request's catch-up forward runs over
    original = DraftModelDrafter._logprobs

    def logprobs(self, batch):
        if batch.mode == ForwardMode.EXTEND:
            caught_up.extend(batch.extend_lens)
        return original(self, batch)

    monkeypatch.setattr(DraftModelDrafter, "_logprobs", logprobs)
    base = prompts(1, seed=5)[0] * 3
    batch = [base + p for p in prompts(6, seed=6)]
    plain = make_spec_scheduler(peaky_model_dir, chunked_prefill_size=16)
    expected = [r.output_ids for r in run(plain, batch, 40, temperature=0.0, at_once=2)]
    s = standalone(
        peaky_model_dir,
        peaky_model_dir,
        chunked_prefill_size=16,
        speculative_eagle_topk=1,
        speculative_num_steps=4,
        speculative_num_draft_tokens=5,
    )
    reqs = run(s, batch, 40, temperature=0.0, at_once=2)
    assert [r.output_ids for r in reqs] == expected
    assert sum(r.cached_tokens for r in reqs) > 0
    assert accepted_per_round(s) > 3.4  # of 4 drafted (a request's last round is cut short)
    # 4 accepted: levels 1-3 computed three, the fourth and the root left (5 without copies)
    assert statistics.median(caught_up) <= 2


def test_a_measured_cost_model_prices_the_drafts_catch_up_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peaky_model_dir: str
) -> None:
    """Measured at start-up, a draft model's cost model holds what its KV costs a token to
    catch up: its first draft over the measuring prefix, less a draft of a row it is level
    with, a token of the prefix. Each catch-up token made to cost 0.2 ms more here (the draft
    otherwise as cheap as the target, a tiny model), the model says at least that; the
    planner charges it (tests/test_planner.py)."""
    from spectral.worker import cost_measure

    original = DraftModelDrafter._logprobs

    def logprobs(self, batch):
        if batch.mode == ForwardMode.EXTEND:
            until = time.perf_counter() + 0.0002 * sum(batch.extend_lens)
            while time.perf_counter() < until:
                pass
        return original(self, batch)

    monkeypatch.setattr(DraftModelDrafter, "_logprobs", logprobs)
    monkeypatch.setattr(cost_measure, "CACHE_DIR", tmp_path)
    s = standalone(peaky_model_dir, peaky_model_dir, speculative_cost_model=None)
    assert s.worker.cost_model.catch_up >= 0.2
    assert s.worker.cost_model.summary()["catch_up_ms_per_token"] >= 0.2


def test_retraction_and_aborts_keep_output_equal_and_free_everything(
    peaky_model_dir: str, draft_dir: str
) -> None:
    batch = prompts(8, seed=7)
    plain = make_spec_scheduler(peaky_model_dir, num_kv_slots=260)
    expected = [r.output_ids for r in run(plain, batch, temperature=0.0, max_new_tokens=40)]
    s = standalone(peaky_model_dir, peaky_model_dir, num_kv_slots=260)
    s.new_token_ratio = MIN_NEW_TOKEN_RATIO  # admit as if outputs were short: the pool runs out
    assert [r.output_ids for r in run(s, batch, temperature=0.0, max_new_tokens=40)] == expected
    assert s.stats.retractions > 0
    reqs = [Req(f"a{i}", p, SamplingParams(max_new_tokens=60)) for i, p in enumerate(batch[:4])]
    for r in reqs:
        s.add_request(r)
    for _ in range(4):
        s.step()
    s.abort("a1")
    s.abort("a3")
    while s.has_work:
        s.step()
    assert scheduler_leaks(s) == []
    assert reqs[1].finished_reason.type == "abort"


def check_grammars_keep_greedy_output(model_dir: str, spec) -> None:
    """Greedy output under two regexes: the speculative scheduler `spec` (which runs rounds)
    gives plain decoding's."""
    batch = prompts(6, seed=9)
    grammars = [{"regex": "(yes|no), [0-9]{2,4}"}, {"regex": "[a-f]{3,12}"}]
    expected = {}
    for name, s in (("plain", make_spec_scheduler(model_dir)), ("spec", spec)):
        outputs = []
        for grammar in grammars:
            outputs += [r.output_ids for r in run(s, batch, temperature=0.0, **grammar)]
        expected[name] = outputs
    assert spec.stats.spec_verify_ct > 0
    assert not scheduler_leaks(spec)
    assert expected["spec"] == expected["plain"]


def test_grammars_keep_greedy_output_equal(peaky_model_dir: str) -> None:
    check_grammars_keep_greedy_output(peaky_model_dir, standalone(peaky_model_dir, peaky_model_dir))


def sampled_pairs(s, prompt: list[int], n: int) -> Counter:
    """The second and third tokens of `n` samples (the first comes from the prefill; the
    others from one speculative round)."""
    reqs = run(s, [prompt] * n, max_new_tokens=3, temperature=1.0, top_k=3)
    return Counter(tuple(r.output_ids[1:]) for r in reqs)


def test_sampled_output_follows_plain_sampling_and_a_control_without_verification_fails(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chi-squared over the 9 two-token continuations at temperature 1 (top-k 3): speculation with
    the target as its own draft against plain sampling; then the same with verification
    replaced by accepting the drafts the target's most likely tokens agree with, which must
    fail."""
    prompt = prompts(1, seed=13)[0]
    plain = sampled_pairs(make_spec_scheduler(tiny_model_dir, max_running_requests=64), prompt, 240)
    options = dict(
        speculative_eagle_topk=3,
        speculative_num_steps=2,
        speculative_max_batch_size=64,
        max_running_requests=64,
    )
    make = functools.partial(standalone, tiny_model_dir, tiny_model_dir, **options)
    check_sampling_and_control(monkeypatch, plain, make, lambda s: sampled_pairs(s, prompt, 240))


def check_sampling_and_control(monkeypatch, plain: Counter, make, sample, accepted: float = 0.5):
    """`sample(make())` follows the `plain` samples (chi-squared), its rounds accepting more than
    `accepted` drafts a round; with verification replaced by accepting the drafts the target's
    most likely tokens agree with, it must not."""
    s = make()
    spec = sample(s)
    assert accepted_per_round(s) > accepted  # drafts were accepted: verification was exercised
    keys = sorted(set(plain) | set(spec))
    stat, dof = two_sample_chi2(plain, spec, keys)
    assert stat < chi2_critical(dof), (plain, spec)

    monkeypatch.setattr(
        spec_verify,
        "verify_sampling",
        lambda trees, probs, generators: verify_greedy(trees, probs.argmax(-1)),
    )
    control = sample(make())
    keys = sorted(set(plain) | set(control))
    stat, dof = two_sample_chi2(plain, control, keys)
    assert stat > chi2_critical(max(dof, 1)), (plain, control)


def test_a_draft_with_another_tokenizer_is_refused_naming_both(
    tmp_path: Path, peaky_model_dir: str, draft_dir: str
) -> None:
    other = Path(make_tiny_model(tmp_path / "other", draft_dir, seed=4, hidden_size=32))
    tokenizer = AutoTokenizer.from_pretrained(str(other))
    tokenizer.add_tokens(["<only-in-the-draft>"])
    tokenizer.save_pretrained(str(other))
    args = ServerArgs(
        model_path=peaky_model_dir,
        dtype="float32",
        max_total_tokens=512,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(other),
        speculative_fixed_tree=True,
    )
    model, _ = resolve_model(args)
    with pytest.raises(ValueError, match="another tokenizer") as err:
        create_worker(args, model)
    assert str(other) in str(err.value) and peaky_model_dir in str(err.value)


def test_standalone_needs_a_draft_model() -> None:
    with pytest.raises(ValueError, match="STANDALONE needs --speculative-draft-model-path"):
        ServerArgs(model_path="default", speculative_algorithm="STANDALONE")


def drafted_tokens(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every candidate token the draft model drafts from now on (recorded as drafted)."""
    seen: list[torch.Tensor] = []
    original = DraftModelDrafter.draft

    def draft(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(out[1].flatten())
        return out

    monkeypatch.setattr(DraftModelDrafter, "draft", draft)
    return seen


def test_a_token_map_drafts_only_its_tokens_and_keeps_output_equal(
    tmp_path: Path, peaky_model_dir: str, plain_outputs: list[list[int]], monkeypatch
) -> None:
    """The target as its own draft: with a map holding every token plain decoding emits, its
    restricted head's top-1 is the full head's wherever it matters, so rounds accept exactly
    what they accept without the map; a map lacking the most frequent of them still gives
    plain decoding's output, accepting less. Every drafted token is in the map."""
    expected = plain_outputs[:8]
    emitted = Counter(t for out in expected for t in out)
    full = sorted(set(emitted) | set(range(2000)))
    lacking = sorted(set(full) - {t for t, _ in emitted.most_common(3)})
    options = dict(
        speculative_eagle_topk=1, speculative_num_steps=4, speculative_num_draft_tokens=5
    )
    stats = {}
    for name, ids in (("none", None), ("full", full), ("lacking", lacking)):
        seen = drafted_tokens(monkeypatch)
        path = None
        if ids is not None:
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps(ids))
        s = standalone(peaky_model_dir, peaky_model_dir, speculative_token_map=path, **options)
        reqs = run(s, prompts(20)[:8], at_once=4, temperature=0.0)
        assert [r.output_ids for r in reqs] == expected, name
        drafted = torch.cat(seen).unique()
        if ids is not None:
            assert set(drafted.tolist()) <= set(ids), name
        stats[name] = (s.stats.spec_verify_ct, s.stats.spec_emitted_tokens)
    assert stats["full"] == stats["none"]
    rounds, tokens = stats["lacking"]
    assert tokens / rounds < stats["full"][1] / stats["full"][0]
