"""Plain decode steps launched ahead of their results (scheduler/overlap.py, worker/pipeline.py)
against the scheduler without them: the same tokens, requests finishing and aborted while a
step is out, requests that need the host taking the usual path, nothing leaked."""

from __future__ import annotations

from spectral.core.req import Req
from spectral.sampling_params import SamplingParams
from tests.conftest import make_scheduler, peaky_model_dir, scheduler_leaks  # noqa: F401


def _prompts(count: int) -> list[list[int]]:
    return [[5 + i, 40 + 3 * i, 7, 300 + i, 11][: 2 + i % 4] for i in range(count)]


def _run(s, reqs: list[Req], abort_at: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Every request's output ids after stepping `s` until it is idle; `abort_at`: a request
    aborted once it has that many output tokens."""
    for req in reqs:
        s.add_request(req)
    abort_at = dict(abort_at or {})
    while s.has_work:
        s.step()
        for rid, count in list(abort_at.items()):
            req = next(r for r in reqs if r.rid == rid)
            if len(req.output_ids) >= count:
                s.abort(rid)
                del abort_at[rid]
    assert scheduler_leaks(s) == []
    return {req.rid: list(req.output_ids) for req in reqs}


def _requests(params: list[dict], prompts: list[list[int]]) -> list[Req]:
    return [Req(f"r{i}", p, SamplingParams(**kw)) for i, (p, kw) in enumerate(zip(prompts, params))]


def test_steps_launched_ahead_give_the_same_tokens(peaky_model_dir):  # noqa: F811
    """Greedy and sampled (seeded) requests of different lengths, one stopped by a token it
    emits mid-way (finished while the next step is out), one with a repetition penalty (it
    needs the host each step: the batch goes the usual way while it runs)."""
    prompts = _prompts(6)
    params = [{"temperature": 0, "max_new_tokens": 5 + 6 * i, "ignore_eos": True} for i in range(6)]
    params[1] |= {"temperature": 0.8, "top_p": 0.9, "seed": 11}
    params[3] |= {"temperature": 1.0, "top_k": 20, "seed": 5}
    plain = make_scheduler(peaky_model_dir)
    expected = _run(plain, _requests(params, prompts))
    stop_at = expected["r4"][6]  # r4 stops at its 7th token (or sooner, where it repeats)
    params[4] |= {"stop_token_ids": [stop_at]}
    expected = _run(plain, _requests(params, prompts))
    assert len(expected["r4"]) < 5 + 6 * 4

    overlapped = make_scheduler(peaky_model_dir, overlap_schedule=True)
    assert _run(overlapped, _requests(params, prompts)) == expected
    ahead = overlapped.stats.decode_steps_ahead
    assert ahead > 20  # most steps were launched before the previous one's tokens were in

    params[2] |= {"repetition_penalty": 1.3}
    expected = _run(plain, _requests(params, prompts))
    assert _run(overlapped, _requests(params, prompts)) == expected
    # launched ahead only after the penalised request had finished
    launched = overlapped.stats.decode_steps_ahead - ahead
    assert 0 < launched < max(len(out) for out in expected.values()) - len(expected["r2"]) + 1


def test_a_request_aborted_while_a_step_is_out_leaves_the_others_as_they_were(
    peaky_model_dir,  # noqa: F811
):
    prompts = _prompts(4)
    params = [{"temperature": 0, "max_new_tokens": 24, "ignore_eos": True} for _ in range(4)]
    expected = _run(make_scheduler(peaky_model_dir), _requests(params, prompts))
    s = make_scheduler(peaky_model_dir, overlap_schedule=True)
    got = _run(s, _requests(params, prompts), abort_at={"r1": 5})
    assert s.stats.decode_steps_ahead > 0
    assert {rid: out for rid, out in got.items() if rid != "r1"} == {
        rid: out for rid, out in expected.items() if rid != "r1"
    }
    assert 5 <= len(got["r1"]) < 24 and got["r1"] == expected["r1"][: len(got["r1"])]


def test_a_request_arriving_while_steps_run_ahead_is_admitted(peaky_model_dir):  # noqa: F811
    """A request added while a step is out: the overlap stops launching ahead, the request is
    prefilled next, and every output is what the plain scheduler gives."""
    prompts = _prompts(3)
    params = [{"temperature": 0, "max_new_tokens": 16, "ignore_eos": True} for _ in range(3)]
    results = []
    for overlap in (False, True):
        s = make_scheduler(peaky_model_dir, overlap_schedule=overlap)
        reqs = _requests(params, prompts)
        s.add_request(reqs[0])
        s.add_request(reqs[1])
        for _ in range(6):
            s.step()
        assert not overlap or s.overlap.busy
        results.append(_run(s, [reqs[2]]) | {r.rid: list(r.output_ids) for r in reqs[:2]})
    assert results[0] == results[1]


def test_the_engine_launches_ahead_through_the_graph_runners_buckets(peaky_model_dir):  # noqa: F811
    """`--enable-overlap-schedule` with the static-buffer path (`--cuda-graph-bs`, run eagerly
    on a CPU): the same tokens as the plain engine; `--disable-overlap-schedule` wins."""
    from spectral import Engine
    from spectral.args import ServerArgs

    prompts = _prompts(5)
    params = [{"temperature": 0, "max_new_tokens": 6 + 5 * i, "ignore_eos": True} for i in range(5)]
    outputs = []
    for options in ({}, {"enable_overlap_schedule": True, "cuda_graph_bs": [1, 2, 4, 8]}):
        engine = Engine(model_path=peaky_model_dir, dtype="float32", **options)
        try:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            ahead = engine.scheduler.stats.decode_steps_ahead
            assert (ahead > 10) == bool(options)
            assert scheduler_leaks(engine.scheduler) == []
        finally:
            engine.shutdown()
        outputs.append([o["output_ids"] for o in outs])
    assert outputs[0] == outputs[1]
    both = ServerArgs(enable_overlap_schedule=True, disable_overlap_schedule=True)
    assert not both.resolved_overlap_schedule()
    assert not ServerArgs(device="cpu").resolved_overlap_schedule()


def test_a_server_launches_ahead_through_its_worker_process(peaky_model_dir):  # noqa: F811
    """The worker in its own process (--worker-process): steps launched ahead travel as
    LaunchStep and come back one late; concurrent requests get the in-process scheduler's
    tokens, and a request that needs the host (a repetition penalty) joins and leaves in the
    middle."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.server_utils import start_server, stop_server

    prompts = _prompts(6)
    params = [{"temperature": 0, "max_new_tokens": 8 + 4 * i, "ignore_eos": True} for i in range(6)]
    params[0] |= {"repetition_penalty": 1.2}  # the shortest: the rest run ahead after it
    expected = _run(make_scheduler(peaky_model_dir), _requests(params, prompts))
    proc, url = start_server(
        "--model-path",
        peaky_model_dir,
        "--dtype",
        "float32",
        "--enable-overlap-schedule",
        "--worker-process",
    )
    try:

        def generate(i: int) -> list[int]:
            body = {"input_ids": prompts[i], "sampling_params": params[i]}
            reply = httpx.post(url + "/generate", json=body, timeout=120)
            return reply.json()["output_ids"]

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(generate, range(6)))
        stats = httpx.get(url + "/get_server_info", timeout=30).json()
        assert stats["stats"]["decode_steps_ahead"] > 0, stats["stats"]
    finally:
        stop_server(proc)
    assert got == [expected[f"r{i}"] for i in range(6)]
