"""The scheduler: prefix sharing, chunked prefill, retraction and aborts give the same outputs
as plain runs and leak nothing."""

from __future__ import annotations

import random

import pytest

from spectral.sampling_params import SamplingParams
from spectral.scheduler.prefill import order_waiting
from spectral.scheduler.req import Req
from tests.conftest import make_scheduler, scheduler_leaks


def greedy_req(rid: str, ids: list[int], max_new: int) -> Req:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    return Req(rid=rid, input_ids=list(ids), sampling_params=params)


def run_all(scheduler, reqs: list[Req], one_at_a_time: bool = False) -> dict[str, list[int]]:
    """Run requests to completion (all queued at once, or each alone); outputs by rid."""
    groups = [[r] for r in reqs] if one_at_a_time else [reqs]
    for group in groups:
        for req in group:
            scheduler.add_request(req)
        steps = 0
        while not all(r.finished for r in group):
            scheduler.step()
            steps += 1
            assert steps < 20_000, "scheduler made no progress"
    return {r.rid: r.output_ids for r in reqs}


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of mixed lengths, some sharing long prefixes (few-shot style)."""
    rng = random.Random(seed)
    stems = [[rng.randrange(3, 49152) for _ in range(length)] for length in (60, 120, 7)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 50))]
        prompts.append((stems[i % 3] if i % 4 else []) + tail)
    return prompts


def fresh(prompts: list[list[int]], max_new: int = 12) -> list[Req]:
    return [greedy_req(f"r{i}", p, max_new) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def baseline(peaky_model_dir) -> dict[str, list[int]]:
    """32 requests, one at a time, no radix cache, no chunking."""
    scheduler = make_scheduler(peaky_model_dir, disable_radix_cache=True)
    return run_all(scheduler, fresh(mixed_prompts(32)), one_at_a_time=True)


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunk16"])
@pytest.mark.parametrize("batched", [True, False], ids=["batch32", "batch1"])
def test_outputs_do_not_depend_on_cache_chunking_or_batching(
    peaky_model_dir, baseline, radix, chunk, batched
):
    scheduler = make_scheduler(
        peaky_model_dir, disable_radix_cache=not radix, chunked_prefill_size=chunk
    )
    outputs = run_all(scheduler, fresh(mixed_prompts(32)), one_at_a_time=not batched)
    assert outputs == baseline
    assert scheduler_leaks(scheduler) == []
    if radix:
        assert scheduler.stats.cached_tokens > 0


def test_requests_sharing_a_long_prefix_reuse_it(peaky_model_dir):
    rng = random.Random(5)
    shared = [rng.randrange(3, 49152) for _ in range(500)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(20)] for _ in range(32)]

    cached = make_scheduler(peaky_model_dir, num_kv_slots=800)
    reqs = fresh(prompts, max_new=4)
    with_cache = run_all(cached, reqs)
    assert reqs[0].cached_tokens == 0
    assert all(r.cached_tokens >= 480 for r in reqs[1:])

    uncached = make_scheduler(peaky_model_dir, num_kv_slots=20000, disable_radix_cache=True)
    without_cache = run_all(uncached, fresh(prompts, max_new=4))
    assert with_cache == without_cache
    assert uncached.stats.prefill_tokens == 32 * 520
    assert cached.stats.prefill_tokens <= 520 + 31 * 21  # the prefix once, then the suffixes
    assert scheduler_leaks(cached) == [] and scheduler_leaks(uncached) == []


def test_memory_pressure_retracts_and_still_gives_the_same_outputs(peaky_model_dir):
    rng = random.Random(11)
    specs = [
        ([rng.randrange(3, 49152) for _ in range(rng.randint(10, 120))], rng.randint(60, 200))
        for _ in range(64)
    ]

    def reqs() -> list[Req]:
        return [greedy_req(f"m{i}", ids, new) for i, (ids, new) in enumerate(specs)]

    roomy = make_scheduler(peaky_model_dir, num_kv_slots=100_000)
    expected = run_all(roomy, reqs())
    assert roomy.stats.retractions == 0

    tight = make_scheduler(peaky_model_dir, num_kv_slots=800)
    got = run_all(tight, reqs())
    assert tight.stats.retractions > 0, tight.stats
    assert got == expected
    assert scheduler_leaks(tight) == []
    assert tight.flush_cache()
    assert tight.kv.allocator.free_count == 800


def test_abort_while_waiting_mid_prefill_and_mid_decode_leaks_nothing(peaky_model_dir):
    s = make_scheduler(peaky_model_dir, chunked_prefill_size=16)
    long_prompt = list(range(100, 300))
    mid_prefill = greedy_req("prefill", long_prompt, 50)
    decoding = greedy_req("decode", list(range(300, 320)), 50)
    waiting = greedy_req("waiting", list(range(400, 420)), 50)
    s.add_request(decoding)
    s.add_request(mid_prefill)
    while s.chunked is not mid_prefill or len(decoding.output_ids) < 2:
        s.step()
    assert 0 < mid_prefill.seq_len < len(long_prompt)
    s.add_request(waiting)
    for req in (mid_prefill, decoding, waiting):
        assert s.abort(req.rid) is req
        assert req.finished_reason.type == "abort"
    assert s.abort("unknown") is None
    assert scheduler_leaks(s) == []
    assert not s.has_work


def test_lpm_puts_the_longest_cached_prefix_first(peaky_model_dir):
    s = make_scheduler(peaky_model_dir, schedule_policy="lpm")
    run_all(s, [greedy_req("warm", list(range(10, 60)), 1)])
    short = greedy_req("short", list(range(10, 20)) + [7, 7], 1)
    none = greedy_req("none", [5, 6, 7], 1)
    long = greedy_req("long", list(range(10, 55)) + [9], 1)
    s.waiting.extend([none, short, long])
    assert [r.rid for r in order_waiting(s.waiting, "lpm", s.kv)] == ["long", "short", "none"]
    assert [r.rid for r in order_waiting(s.waiting, "fcfs", s.kv)] == ["none", "short", "long"]
