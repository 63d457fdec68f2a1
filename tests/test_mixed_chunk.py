"""Prefill steps that decode the running requests too (--enable-mixed-chunk) against the
scheduler without them: the same tokens and logprobs (a float32 forward of a request's token
among other requests' prompt tokens), with sampling, penalties and prompts prefilled in chunks,
under speculation; nothing leaked."""

from __future__ import annotations

import pytest

from spectral.core.req import Req
from spectral.sampling_params import SamplingParams
from tests.conftest import make_scheduler, peaky_model_dir, scheduler_leaks  # noqa: F401
from tests.test_speculative import (  # noqa: F401
    eagle3_head,
    hybrid_scheduler,
    make_spec_scheduler,
    prompts,
)


def _params(i: int) -> dict:
    kinds = [
        {"temperature": 0},
        {"temperature": 0.8, "top_p": 0.9, "seed": 11 + i},
        {"temperature": 0, "repetition_penalty": 1.3},
    ]
    return kinds[i % 4 % 3] | {"max_new_tokens": 3 + 5 * (i % 5), "ignore_eos": True}


def _logprobs(i: int) -> dict:
    """Every fourth request asks for logprobs: its prompt's, its output's and the top two."""
    wanted = i % 4 == 3
    return dict(
        return_logprob=wanted, logprob_start_len=0 if wanted else -1, top_logprobs_num=2 * wanted
    )


def _mixed_steps(s) -> list[int]:
    """The sizes of the running batches that decoded in prefill steps (recorded as they run)."""
    sizes: list[int] = []
    run_batch = s._run

    def recorded(batch):
        if batch.decoding:
            sizes.append(len(batch.decoding))
        return run_batch(batch)

    s._run = recorded
    return sizes


def _generate(s, count: int) -> list[Req]:
    reqs = [
        Req(f"r{i}", p, SamplingParams(**_params(i)), **_logprobs(i))
        for i, p in enumerate(prompts(count))
    ]
    for req in reqs:
        s.add_request(req)
    while s.has_work:
        s.step()
    assert scheduler_leaks(s) == []
    return reqs


@pytest.mark.parametrize("chunk", [None, 8])
def test_prefill_steps_that_decode_the_running_requests_change_no_token(
    peaky_model_dir,  # noqa: F811
    chunk,
):
    """Twelve requests of different lengths, three running at a time: every admission after
    the first finds requests running, which decode in its prefill step; tokens as without,
    logprobs (output, top and the prompt's) within float32 rounding."""
    options = dict(max_running_requests=3, chunked_prefill_size=chunk)
    expected = _generate(make_scheduler(peaky_model_dir, **options), 12)
    s = make_scheduler(peaky_model_dir, mixed_chunk=True, **options)
    mixed = _mixed_steps(s)
    got = _generate(s, 12)
    assert len(mixed) >= 6 and max(mixed) == 2
    assert s.stats.prefill_tokens == sum(len(r.input_ids) - r.cached_tokens for r in got)
    for want, req in zip(expected, got):
        assert req.output_ids == want.output_ids, req.rid
        if want.return_logprob:
            assert req.output_logprobs == pytest.approx(want.output_logprobs, rel=1e-5, abs=1e-4)
            assert req.input_logprobs[1:] == pytest.approx(
                want.input_logprobs[1:], rel=1e-5, abs=1e-4
            )
            for tops, want_tops in zip(req.output_top_logprobs, want.output_top_logprobs):
                assert [t[1] for t in tops] == [t[1] for t in want_tops]


def _run_staggered(s, batch: list[list[int]]) -> list[list[int]]:
    """Greedy requests of 8 to 28 new tokens, four in flight: as one finishes the next is
    admitted while the others run."""
    reqs = [
        Req(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=8 + 5 * (i % 5)))
        for i, p in enumerate(batch)
    ]
    pending = list(reqs)
    while pending or s.has_work:
        while pending and len(s.running) + len(s.waiting) < 4:
            s.add_request(pending.pop(0))
        s.step()
    assert scheduler_leaks(s) == []
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3+NGRAM"])
def test_prefill_steps_that_decode_under_speculation_keep_output_plain(
    peaky_model_dir,  # noqa: F811
    eagle3_head,  # noqa: F811
    algorithm,
):
    """Requests admitted while others run, speculating (prompts repeated, so that n-gram
    rounds pay): as plain decoding gives."""
    batch = [p * 3 for p in prompts(12, seed=3)]
    plain = _run_staggered(make_spec_scheduler(peaky_model_dir), batch)
    if algorithm == "NGRAM":
        s = make_spec_scheduler(peaky_model_dir, speculative_algorithm="NGRAM", mixed_chunk=True)
    else:
        s = hybrid_scheduler(peaky_model_dir, eagle3_head, mixed_chunk=True)
    mixed = _mixed_steps(s)
    assert _run_staggered(s, batch) == plain
    assert len(mixed) >= 4 and s.stats.spec_verify_ct > 0
