"""The model worker in its own process: same outputs as in-process, a clear error when it dies,
no process left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel
from spectral.core.req import Req
from spectral.models.resolved import load_tokenizer, resolve_model
from spectral.sampling_params import SamplingParams
from spectral.scheduler.config import SchedulerConfig
from spectral.scheduler.scheduler import Scheduler
from spectral.server.worker_process import RemoteWorker, WorkerDiedError
from tests.conftest import make_scheduler, scheduler_leaks
from tests.test_scheduler import fresh, mixed_prompts, run_all


def remote_args(model_dir: str, **options) -> ServerArgs:
    """The worker process's settings in these tests (`options`: more ServerArgs fields)."""
    return ServerArgs(
        model_path=model_dir,
        dtype="float32",
        max_total_tokens=4096,
        max_running_requests=16,
        log_level="warning",
        **options,
    )


@contextlib.contextmanager
def started_worker(args: ServerArgs, model: ResolvedModel):
    """A worker process for `args`, ready, closed on the way out."""
    with tempfile.TemporaryDirectory() as ipc_dir:
        worker = RemoteWorker(args, ipc_dir).hand_model(model).wait_ready()
        try:
            yield worker
        finally:
            worker.close()


@pytest.fixture()
def remote(peaky_model_dir):
    args = remote_args(peaky_model_dir)
    model, _ = resolve_model(args)
    with started_worker(args, model) as worker:
        yield worker, model


def remote_scheduler(worker: RemoteWorker, model: ResolvedModel, spec=None) -> Scheduler:
    limits = SchedulerConfig(
        num_kv_slots=worker.num_kv_slots,
        max_running_requests=16,
        max_context_len=model.context_len,
        max_prefill_tokens=8192,
        eos_token_ids=(2,),
        vocab_size=model.vocab_size,
    )
    return Scheduler(worker, load_tokenizer(model.tokenizer_dir), limits, spec)


def test_outputs_through_the_worker_process_equal_in_process_and_close_leaves_no_process(
    peaky_model_dir, remote
):
    worker, model = remote
    assert worker.num_kv_slots == 4096
    expected = run_all(make_scheduler(peaky_model_dir), fresh(mixed_prompts(12)))
    scheduler = remote_scheduler(worker, model)
    assert run_all(scheduler, fresh(mixed_prompts(12))) == expected
    assert scheduler_leaks(scheduler) == []
    worker.close()
    assert worker.process.poll() is not None


def test_a_killed_worker_is_reported_within_seconds(remote):
    worker, model = remote
    scheduler = remote_scheduler(worker, model)
    os.kill(worker.process.pid, signal.SIGKILL)
    scheduler.add_request(fresh([[5, 6, 7]])[0])
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="exited with code -9"):
        scheduler.step()
    assert time.monotonic() - start < 5


def grammar_reqs() -> list[Req]:
    grammars = [
        {"regex": "(yes|no), [0-9]{2,4}"},
        {"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'},
    ]
    return [
        Req(f"g{i}", p, SamplingParams(max_new_tokens=16, temperature=0.0, **g))
        for i, (p, g) in enumerate(zip(mixed_prompts(2), grammars))
    ]


def test_a_worker_process_hands_its_cost_model_and_draft_confidence_to_the_planner(
    peaky_model_dir, tmp_path
):
    """With speculation the worker process sends the scheduler its cost model at start-up and
    the head's confidence with every result: the scheduler plans trees by them, and its greedy
    output is plain decoding's."""
    from spectral.speculative.cost_model import CostModel
    from tests.test_speculative import FLAT_COST, cost_model_file, make_random_head

    head = make_random_head(tmp_path / "head", peaky_model_dir, "eagle3")
    args = remote_args(
        peaky_model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head,
        speculative_cost_model=cost_model_file(FLAT_COST),
    )
    model, _ = resolve_model(args)
    expected = run_all(make_scheduler(peaky_model_dir), fresh(mixed_prompts(6)))
    expected_grammar = run_all(make_scheduler(peaky_model_dir), grammar_reqs())
    with started_worker(args, model) as worker:
        assert worker.cost_model == CostModel.from_dict(FLAT_COST)
        scheduler = remote_scheduler(worker, model, args.spec)
        reqs = fresh(mixed_prompts(6))
        assert run_all(scheduler, reqs) == expected
        assert scheduler.spec_round.planner is not None and scheduler.stats.spec_verify_ct > 0
        buckets = scheduler.info()["speculative"]["acceptance"]
        assert any(k.startswith("head:") and k != "head:?" for k in buckets), buckets
        # Grammars: the worker process follows each request's output with its own matcher
        # to mask its trees; the tokens are plain decoding's under the same grammars.
        rounds = scheduler.stats.spec_verify_ct
        assert run_all(scheduler, grammar_reqs()) == expected_grammar
        assert scheduler.stats.spec_verify_ct > rounds
        assert scheduler_leaks(scheduler) == []


def test_a_draft_model_speculates_through_the_worker_process(peaky_model_dir):
    """STANDALONE (the target as its own draft) in the worker process: the draft LM loads
    there beside the target, rounds are verified, greedy output is plain decoding's, nothing
    leaks."""
    from tests.test_speculative import FLAT_COST, cost_model_file

    args = remote_args(
        peaky_model_dir,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=peaky_model_dir,
        speculative_cost_model=cost_model_file(FLAT_COST),
    )
    model, _ = resolve_model(args)
    expected = run_all(make_scheduler(peaky_model_dir), fresh(mixed_prompts(6)))
    with started_worker(args, model) as worker:
        scheduler = remote_scheduler(worker, model, args.spec)
        assert run_all(scheduler, fresh(mixed_prompts(6))) == expected
        stats = scheduler.stats
        assert stats.spec_emitted_tokens > 2 * stats.spec_verify_ct > 0
        assert scheduler_leaks(scheduler) == []


# A child process told to stop twice: the first SIGTERM begins its shutdown (the `finally` that
# stops the worker), the second arrives during it (the launcher signals each child after its
# process group was signalled).
SIGTERM_TWICE = """
import os, signal, sys, time
from spectral.server.child import exit_on_sigterm
if sys.argv[1] == "once":
    exit_on_sigterm()
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
finally:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("worker stopped", flush=True)
"""


def test_a_second_sigterm_does_not_break_off_the_shutdown_the_first_began():
    """The scheduler process's handler exits once and then ignores SIGTERM, so its `finally`
    runs to the end; a handler exiting on every SIGTERM (the one before) breaks it off."""
    for mode, finishes in (("once", True), ("every", False)):
        done = subprocess.run(
            [sys.executable, "-c", SIGTERM_TWICE, mode], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert ("worker stopped" in done.stdout) == finishes, (mode, done.stdout, done.stderr)


def test_a_server_with_a_worker_process_answers_and_stops_with_an_error_when_it_dies(
    peaky_model_dir,
):
    """--worker-process: the model worker in a process of its own answers as the in-process
    scheduler does; SIGKILLed, it takes the server down with an error within seconds, and no
    process of the server is left."""
    import httpx

    from tests.server_utils import server_processes, start_server, stop_server, survivors_after

    ids = mixed_prompts(1, seed=7)[0]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    req = Req("r0", ids, SamplingParams(**params))
    expected = run_all(make_scheduler(peaky_model_dir), [req])["r0"]
    proc, url = start_server(
        "--model-path", peaky_model_dir, "--dtype", "float32", "--worker-process"
    )
    try:
        body = {"input_ids": ids, "sampling_params": params}
        got = httpx.post(url + "/generate", json=body, timeout=60).json()["output_ids"]
        family = server_processes(proc)
        workers = [pid for pid, cmd in family.items() if "spectral.server.worker_process" in cmd]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=10) != 0
    finally:
        if proc.poll() is None:
            stop_server(proc)
    assert got == expected
    assert not [family[pid] for pid in survivors_after(list(family))]
