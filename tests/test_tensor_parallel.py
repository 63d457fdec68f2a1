"""`--tp-size 2`: greedy output identical to one rank on the peaky model's 20 test prompts,
plain, with EAGLE3 speculation and under a grammar, through the Engine (its worker is the
server's worker process, rank 0, starting rank 1) and through the server (native and OpenAI
requests), and over two "machines" (--nnodes 2 on this one); seeded sampling with speculation
equal too; no process left after the Engine's shutdown (SIGTERM to rank 0); a SIGKILLed rank,
on this node or another, taking the server down within 10 s with nothing left."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from spectral import Engine
from spectral.args import ServerArgs
from tests.server_utils import (
    cmdline,
    descendants,
    free_port,
    start_server,
    stop_server,
    survivors_after,
)
from tests.test_speculative import FLAT_COST, cost_model_file, make_random_head, prompts

PROMPTS = prompts(20)
REGEX = r"(yes|no), because [a-z]+[.]"
GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory: pytest.TempPathFactory, peaky_model_dir: str) -> str:
    return make_random_head(tmp_path_factory.mktemp("eagle3-head"), peaky_model_dir, "eagle3")


def engine_options(model_dir: str, head: str | None = None) -> dict:
    options = dict(model_path=model_dir, dtype="float32", max_total_tokens=4096)
    if head is not None:  # rounds every step, with the largest trees (FLAT_COST)
        options |= dict(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=head,
            speculative_eagle_topk=2,
            speculative_num_steps=3,
            speculative_num_draft_tokens=6,
            speculative_cost_model=cost_model_file(FLAT_COST),
        )
    return options


def engine_outputs(tp_size: int, **options) -> dict[str, list]:
    """Greedy outputs of the 20 prompts, of three under the regex, and of four seeded sampled
    requests; the rounds run (0 without speculation)."""
    with Engine(tp_size=tp_size, **options) as engine:
        ranks = []  # the worker process (rank 0) and the ranks it started
        if tp_size > 1:
            ranks = [engine.worker.process.pid, *descendants(engine.worker.process.pid)]
        greedy = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        regex = engine.generate(input_ids=PROMPTS[:3], sampling_params={**GREEDY, "regex": REGEX})
        sampled = engine.generate(
            input_ids=PROMPTS[:4],
            sampling_params=[
                {"temperature": 1.0, "seed": i, "max_new_tokens": 12} for i in range(4)
            ],
        )
        rounds = engine.get_server_info()["stats"]["spec_verify_ct"]
    return {
        "greedy": [o["output_ids"] for o in greedy],
        "regex": [o["text"] for o in regex],
        "sampled": [o["output_ids"] for o in sampled],
        "rounds": rounds,
        "ranks": ranks,
    }


@pytest.fixture(scope="module")
def one_rank(peaky_model_dir: str) -> dict[str, list]:
    return engine_outputs(1, **engine_options(peaky_model_dir))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle3"])
def test_the_engine_on_two_ranks_gives_one_ranks_output(
    speculative: bool, peaky_model_dir: str, eagle3_head: str, one_rank: dict
):
    options = engine_options(peaky_model_dir, eagle3_head if speculative else None)
    got = engine_outputs(2, **options)
    assert got["greedy"] == one_rank["greedy"]
    assert got["regex"] == one_rank["regex"]
    assert all(text.split(", because ")[0] in ("yes", "no") for text in got["regex"])
    # seeded sampling: the same draws on every rank (speculative: verification's too)
    expected = engine_outputs(1, **options)["sampled"] if speculative else one_rank["sampled"]
    assert got["sampled"] == expected
    assert (got["rounds"] > 50) == speculative
    assert len(got["ranks"]) == 2
    assert survivors_after(got["ranks"]) == []  # shutdown stopped both ranks


def generate_all(url: str, prompts: list[list[int]]) -> list[dict]:
    """The greedy /generate responses of `prompts`, sent together (the server batches them,
    as the Engine that gave the oracle did)."""

    def one(ids: list[int]) -> dict:
        res = httpx.post(
            url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=120
        )
        assert res.status_code == 200, res.text
        return res.json()

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def assert_a_lost_rank_is_named(server: subprocess.Popen, log: Path, others: list[int]) -> None:
    """The server exits non-zero within 10 s, its log naming the rank that went, and nothing
    of `others` (its processes and any other node's) is left 10 s later."""
    server.wait(timeout=10)
    assert server.returncode != 0
    assert "tensor-parallel rank 1" in log.read_text()
    assert survivors_after(others) == []


def test_the_server_on_two_ranks_speculating_gives_one_ranks_output_until_a_rank_is_killed(
    peaky_model_dir: str, eagle3_head: str, one_rank: dict, tmp_path: Path
):
    """Native, regex and OpenAI requests give one rank's output (the completion's text is the
    native request's for its prompt). Then rank 1 SIGKILLed: the server exits within 10 s
    (rank 0 names it) and nothing of it is left."""
    flags = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in engine_options(peaky_model_dir, eagle3_head).items()
    ]
    log = tmp_path / "server.log"
    server, url = start_server(*flags, "--tp-size", "2", timeout=240, log=log)
    try:
        # the scheduler, the detokenizer, the worker (rank 0) and its rank 1 at least
        assert len(descendants(server.pid)) >= 4
        responses = generate_all(url, PROMPTS)
        assert [r["output_ids"] for r in responses] == one_rank["greedy"]
        res = httpx.post(
            url + "/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "regex": REGEX}},
            timeout=120,
        )
        assert res.status_code == 200, res.text
        assert res.json()["text"] == one_rank["regex"][0]
        res = httpx.post(
            url + "/v1/completions",
            json={"model": "x", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0},
            timeout=120,
        )
        assert res.status_code == 200, res.text
        assert res.json()["choices"][0]["text"] == responses[1]["text"]
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        assert info["stats"]["spec_verify_ct"] > 20
        below = descendants(server.pid)
        workers = [pid for pid in below if "spectral.server.worker_process" in cmdline(pid)]
        assert len(workers) == 2
        parents = {
            pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            for pid in workers
        }
        (rank1,) = [pid for pid in workers if parents[pid] in workers]
        os.kill(rank1, signal.SIGKILL)
        assert_a_lost_rank_is_named(server, log, below)
    finally:
        if server.poll() is None:
            stop_server(server)


def test_bad_rank_layouts_are_refused_saying_what_is_allowed():
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        ServerArgs(tp_size=0)
    with pytest.raises(ValueError, match=r"tp_size \(3\) must be a multiple of nnodes \(2\)"):
        ServerArgs(tp_size=3, nnodes=2, dist_init_addr="10.0.0.1:29500")
    with pytest.raises(ValueError, match="nnodes > 1 needs --dist-init-addr HOST:PORT"):
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank must be in 0..nnodes-1"):
        ServerArgs(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:29500")
    with pytest.raises(ValueError, match="does not go with --dp-size"):
        ServerArgs(tp_size=2, nnodes=2, dp_size=2, dist_init_addr="10.0.0.1:29500")


def test_two_machines_serve_as_one_and_a_lost_rank_takes_the_server_down(
    peaky_model_dir: str, one_rank: dict, tmp_path: Path
):
    """--nnodes 2 on this machine: node 1 (`--node-rank 1`: rank 1 only, no HTTP) and node 0
    (the server, rank 0) meet at --dist-init-addr; greedy output equals one rank's. Rank 1
    SIGKILLed on node 1: the server exits within 10 s (its batch socket saw rank 1 go), node
    1's launcher too, rank 0's log naming rank 1, and nothing is left of either."""
    port = free_port(2)  # the group's rendezvous and rank 0's batch socket
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_options(peaky_model_dir).items()]
    flags += ["--tp-size=2", "--nnodes=2", f"--dist-init-addr=127.0.0.1:{port}"]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "spectral.launch_server", *flags, "--node-rank=1"],
        start_new_session=True,
    )
    server = None
    log = tmp_path / "server.log"
    try:
        server, url = start_server(*flags, "--node-rank=0", timeout=240, log=log)
        responses = generate_all(url, PROMPTS[:5])
        assert [r["output_ids"] for r in responses] == one_rank["greedy"][:5]
        below = descendants(server.pid) + descendants(node1.pid)
        (rank1,) = [
            p for p in descendants(node1.pid) if "spectral.server.worker_process" in cmdline(p)
        ]
        os.kill(rank1, signal.SIGKILL)
        node1.wait(timeout=10)
        assert node1.returncode != 0
        assert_a_lost_rank_is_named(server, log, below)
    finally:
        for proc in (server, node1):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
