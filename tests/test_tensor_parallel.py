"""`--tp-size 2` through the server's processes: greedy output identical to one rank on the
peaky model (native and OpenAI requests), the worker's rank processes gone after SIGTERM, a
SIGKILLed rank taking the server down within 10 s with nothing left, and what tensor
parallelism does not run yet refused with a message."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from spectral import Engine
from spectral.args import ServerArgs
from tests.server_utils import alive, cmdline, descendants, start_server, stop_server

PROMPTS = ["The capital of France", "def fib(n):", "1, 2, 3,", "Once upon a time", "SELECT"]


def greedy(url: str) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        res = httpx.post(
            url + "/generate",
            json={"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
            timeout=120,
        )
        assert res.status_code == 200, res.text
        out.append(res.json()["output_ids"])
    return out


def test_two_ranks_give_one_ranks_greedy_output_and_leave_no_process(peaky_model_dir):
    flags = ("--model-path", peaky_model_dir, "--dtype", "float32", "--max-total-tokens", "4096")
    one, url = start_server(*flags)
    try:
        expected = greedy(url)
    finally:
        stop_server(one)
    two, url = start_server(*flags, "--tp-size", "2", timeout=240)
    try:
        # the scheduler, the detokenizer, the worker (rank 0) and its rank 1 at least
        assert len(descendants(two.pid)) >= 4
        assert greedy(url) == expected
        res = httpx.post(
            url + "/v1/completions",
            json={"model": "x", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0},
            timeout=120,
        )
        assert res.status_code == 200, res.text
    finally:
        stop_server(two)  # asserts every process it started is gone


def test_a_killed_rank_takes_the_server_down_naming_it_and_leaves_no_process(peaky_model_dir):
    flags = ("--model-path", peaky_model_dir, "--dtype", "float32", "--tp-size", "2")
    server, url = start_server(*flags, "--max-total-tokens", "4096", timeout=240)
    try:
        below = descendants(server.pid)
        workers = [pid for pid in below if "spectral.server.worker_process" in cmdline(pid)]
        assert len(workers) == 2
        parents = {
            pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            for pid in workers
        }
        rank1 = next(pid for pid in workers if parents[pid] in workers)
        os.kill(rank1, signal.SIGKILL)
        server.wait(timeout=10)
        assert server.returncode != 0
        time.sleep(1)
        assert not [pid for pid in below if alive(pid)]
    finally:
        if server.poll() is None:
            stop_server(server)


def test_what_tensor_parallelism_does_not_run_yet_is_refused():
    with pytest.raises(ValueError, match="does not yet run speculative decoding"):
        ServerArgs(tp_size=2, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        ServerArgs(tp_size=0)
    with pytest.raises(ValueError, match="the offline Engine runs one worker"):
        Engine(tp_size=2)
