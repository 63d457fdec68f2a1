"""The scheduler: prefix sharing, chunked prefill, retraction and aborts give the same outputs
as plain runs and leak nothing."""

from __future__ import annotations

import random

import pytest

from spectral.core.req import Req
from spectral.sampling_params import SamplingParams
from spectral.scheduler.prefill import order_waiting
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
        ([rng.randrange(3, 49152) for _ in range(rng.randint(10, 120))], rng.randint(40, 120))
        for _ in range(32)
    ]

    def reqs() -> list[Req]:
        return [greedy_req(f"m{i}", ids, new) for i, (ids, new) in enumerate(specs)]

    roomy = make_scheduler(peaky_model_dir, num_kv_slots=100_000)
    expected = run_all(roomy, reqs())
    assert roomy.stats.retractions == 0

    tight = make_scheduler(peaky_model_dir, num_kv_slots=300)
    got = run_all(tight, reqs())
    assert tight.stats.retractions > 0, tight.stats
    assert got == expected
    assert scheduler_leaks(tight) == []
    assert tight.flush_cache()
    assert tight.kv.allocator.free_count == 300


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
    assert [r.rid for r in order_waiting(s.waiting, "lpm", s.kv, [])] == ["long", "short", "none"]
    assert [r.rid for r in order_waiting(s.waiting, "fcfs", s.kv, [])] == ["none", "short", "long"]


def in_group(req: Req, group: str) -> Req:
    req.group = group
    return req


def test_the_queue_takes_turns_between_groups(peaky_model_dir):
    s = make_scheduler(peaky_model_dir)
    running = [in_group(greedy_req(f"a{i}", [5, 6], 1), "A") for i in range(3)]
    s.waiting.extend(
        [
            in_group(greedy_req("a3", [5], 1), "A"),
            in_group(greedy_req("a4", [5], 1), "A"),
            in_group(greedy_req("b0", [5], 1), "B"),
            greedy_req("solo", [5], 1),
            in_group(greedy_req("b1", [5], 1), "B"),
        ]
    )
    # A has three running: its queued requests wait for B's and solo's first turns.
    order = [r.rid for r in order_waiting(s.waiting, "fcfs", s.kv, running)]
    assert order == ["b0", "solo", "b1", "a3", "a4"]


def test_a_new_client_gets_a_row_from_a_fan_out_that_holds_them_all(peaky_model_dir, baseline):
    prompts = mixed_prompts(32)[:7]
    s = make_scheduler(peaky_model_dir, max_running_requests=4)
    fan_out = [in_group(r, "fan") for r in fresh(prompts[:6])]
    for req in fan_out:
        s.add_request(req)
    while len(s.running) < 4:
        s.step()
    late = fresh(prompts)[6]
    s.add_request(late)
    s.step()  # a decode step follows every prefill
    s.step()
    assert late in s.running and len(s.running) == 4
    assert s.stats.retractions == 1
    while s.has_work:
        s.step()
    assert {r.rid: r.output_ids for r in fan_out + [late]} == {
        r.rid: baseline[r.rid] for r in fan_out + [late]
    }
    assert scheduler_leaks(s) == []


class FailingWorker:
    """A worker that raises on every batch holding request `bad` once it has `after` output
    tokens (a decode row), and runs every other batch."""

    def __init__(self, worker, bad: str, after: int) -> None:
        self.worker, self.bad, self.after = worker, bad, after
        self.failures = 0

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def forward(self, batch):
        for s in batch.sampling:
            if s.rid == self.bad and len(s.output_ids) >= self.after:
                self.failures += 1
                raise RuntimeError("boom")
        return self.worker.forward(batch)


def test_a_worker_failure_on_one_row_fails_only_its_request(peaky_model_dir, baseline):
    """The batch is split until the failing request is alone; it ends aborted with the error,
    keeping in the cache only KV computed before the failure, and the others go on with the
    same outputs as when run alone."""
    s = make_scheduler(peaky_model_dir)
    s.worker = FailingWorker(s.worker, "r3", after=3)
    reqs = fresh(mixed_prompts(32)[:8])
    outputs = run_all(s, reqs)
    bad = reqs[3]
    assert bad.finished_reason.type == "abort" and "boom" in bad.finished_reason.message
    assert len(bad.output_ids) == 3
    assert 1 < s.worker.failures <= 4  # halves of at most 8 rows, down to the row alone
    assert {rid: out for rid, out in outputs.items() if rid != "r3"} == {
        r.rid: baseline[r.rid] for r in reqs if r.rid != "r3"
    }
    assert scheduler_leaks(s) == []
    # Nothing the failed step wrote reached the radix cache: the same request run again
    # (through the cached prefix) gives the output it gives alone.
    s.worker = s.worker.worker
    again = fresh(mixed_prompts(32)[:8])[3]
    assert run_all(s, [again]) == {"r3": baseline["r3"]}
    assert scheduler_leaks(s) == []
