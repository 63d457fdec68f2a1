"""KVManager's slots for a request's next tokens: runs of its own while the pool is roomy,
every slot back in the allocator once the requests are released (a naive model of
ownership beside it)."""

from __future__ import annotations

import random

from spectral.core.req import Req
from spectral.sampling_params import SamplingParams
from spectral.scheduler.kv_manager import SPARE_RUN, KVManager


def request(i: int, prompt: int) -> Req:
    return Req(rid=f"r{i}", input_ids=list(range(1, prompt + 1)), sampling_params=SamplingParams())


def admitted(kv: KVManager, batch: int, prompt: int) -> list[Req]:
    reqs = [request(i, prompt) for i in range(batch)]
    for req in reqs:
        kv.admit(req, req.input_ids)
        req.kv_slots.extend(kv.take(req, prompt))
    return reqs


def grow(req: Req, slots: list[int]) -> None:
    """Tokens computed at `slots`: their KV and, past the prompt, the output they make."""
    req.kv_slots.extend(slots)
    req.output_ids.extend([7] * (len(req.kv_slots) - len(req.all_ids)))


def runs(slots: list[int]) -> list[int]:
    """Lengths of the runs of consecutive slots, in order."""
    out = [1]
    for a, b in zip(slots, slots[1:]):
        if b == a + 1:
            out[-1] += 1
        else:
            out.append(1)
    return out


def test_decode_steps_lay_each_request_in_runs_of_its_own():
    kv = KVManager(4096, max_running_requests=4, disable_radix_cache=True)
    reqs = admitted(kv, 4, prompt=10)
    for _ in range(50):  # decode steps: one slot a request, request after request
        for req in reqs:
            grow(req, kv.take(req, 1))
    for req in reqs:
        # the prompt and its spare run are one run, then runs of SPARE_RUN + 1
        assert runs(req.kv_slots)[0] == 10 + SPARE_RUN
        assert min(runs(req.kv_slots)[:-1]) >= SPARE_RUN
    owned = {s for req in reqs for s in req.kv_slots + req.kv_spare}
    assert len(owned) == sum(len(req.kv_slots) + len(req.kv_spare) for req in reqs)
    assert kv.allocator.free_count == 4096 - len(owned)
    for req in reqs:
        kv.release(req)
    assert kv.allocator.free_count == 4096


def test_a_tight_pool_hands_out_no_spare_slots():
    kv = KVManager(64, max_running_requests=4, disable_radix_cache=True)
    reqs = admitted(kv, 4, prompt=5)
    for req in reqs:
        grow(req, kv.take(req, 1))
        assert req.kv_spare == []
    assert kv.allocator.free_count == 64 - 4 * 6
    kv.give_back(reqs[0], kv.take(reqs[0], 3))  # a tree's rejected nodes: freed again
    assert reqs[0].kv_spare == [] and kv.allocator.free_count == 64 - 4 * 6


def test_rejected_tree_slots_are_taken_again_first_and_nothing_leaks():
    """Speculative rounds: each request takes a tree's slots, keeps an accepted path's and
    gives the rest back; against a model of who owns which slot."""
    rng = random.Random(0)
    kv = KVManager(2048, max_running_requests=3, disable_radix_cache=True)
    reqs = admitted(kv, 3, prompt=7)
    for _ in range(40):
        for req in reqs:
            tree = kv.take(req, rng.randint(1, 12))
            kept = sorted(rng.sample(tree[1:], rng.randint(0, len(tree) - 1)))
            rejected = [s for s in tree if s not in kept and s != tree[0]]
            grow(req, [tree[0], *kept])
            before = sorted(req.kv_spare + rejected)
            kv.give_back(req, rejected)
            assert req.kv_spare == before[: len(req.kv_spare)], "not the lowest kept"
            assert len(req.kv_spare) >= min(len(before), SPARE_RUN)
        everyone = [s for req in reqs for s in req.kv_slots + req.kv_spare]
        assert len(set(everyone)) == len(everyone), "a slot owned twice"
        assert kv.allocator.free_count == 2048 - len(everyone)
    for req in reqs:
        kv.release(req)
    assert kv.allocator.free_count == 2048
