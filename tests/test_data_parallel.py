"""`--dp-size 2`: two spectral servers behind sglang-router. Native and OpenAI requests through
the router give the offline Engine's outputs, concurrent traffic reaches both servers,
bench_serving runs through it, a killed server fails no later request, and SIGTERM leaves no
process behind. The servers run a tiny random Llama with sharp distributions (quick to start,
far from greedy ties), the Engine on the same model is the oracle."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.server_utils import (
    cmdline,
    descendants,
    free_port,
    launch_command,
    run_bench_serving,
    survivors_after,
)

pytest.importorskip("sglang_router", reason="make test installs sglang-router (spectral[router])")

GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def engine(peaky_model_dir):
    from spectral import Engine

    engine = Engine(model_path=peaky_model_dir, dtype="float32", max_total_tokens=8192)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def cluster(peaky_model_dir):
    port = free_port(3)  # the router's and its two servers'
    proc = subprocess.Popen(
        launch_command(
            "--model-path",
            peaky_model_dir,
            "--dtype",
            "float32",
            "--max-total-tokens",
            "8192",
            "--dp-size",
            "2",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--served-model-name",
            "smollm2",
        ),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, f"--dp-size 2 exited with {proc.returncode} while starting"
        try:
            if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the router did not become ready"
        time.sleep(0.5)
    yield proc, url, [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def generated_tokens(server: str) -> int:
    return httpx.get(server + "/get_server_info", timeout=10).json()["stats"]["generated_tokens"]


def generate(url: str, text: str) -> dict:
    res = httpx.post(url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=120)
    assert res.status_code == 200, res.text
    return res.json()


# Distinct beginnings: the cache-aware policy sends prompts sharing over 30% of their
# characters to the server that saw the prefix, and the rest to the least loaded one.
PROMPTS = [
    "Why is the sky blue?",
    "List three prime numbers.",
    "Bees make honey from",
    "Quantum computers use",
    "My favourite recipe for soup",
    "In 1969 the first",
    "Zebras live in",
    "A haiku about rain:",
]


def test_native_and_openai_requests_through_the_router_match_the_engine(cluster, engine):
    _, url, _ = cluster
    expected = engine.generate(PROMPTS[0], GREEDY)["text"]
    assert generate(url, PROMPTS[0])["text"] == expected
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    res = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert res.choices[0].text == expected


def test_concurrent_requests_reach_both_servers(cluster, engine):
    """Bursts of 8 concurrent requests, every output the Engine's, until both servers have
    generated some (at most 3 bursts: once, with the rest of the suite loading the machine, a
    whole burst reached one server; a server the router took out after missed health checks
    comes back after two that pass, 2 s apart)."""
    _, url, servers = cluster
    expected = [o["text"] for o in engine.generate(PROMPTS, GREEDY)]
    before = [generated_tokens(s) for s in servers]
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda p: generate(url, p)["text"], PROMPTS))
        assert outs == expected
        after = [generated_tokens(s) for s in servers]
        if all(a > b for a, b in zip(after, before)):
            break
        time.sleep(2.5)  # the router's next health check (two bursts on: both)
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_bench_serving_through_the_router(cluster, peaky_model_dir, tmp_path):
    _, url, _ = cluster
    [report] = run_bench_serving(url, peaky_model_dir, tmp_path / "bench.jsonl")
    assert report["completed"] == 8 and report["total_output_tokens"] == 8 * 8


def test_a_killed_server_fails_no_later_request_and_sigterm_stops_all(cluster, engine):
    proc, url, servers = cluster
    family = descendants(proc.pid)
    port = servers[1].rsplit(":", 1)[1]
    [victim] = [
        pid
        for pid in family
        if "spectral.launch_server" in cmdline(pid) and f"--port {port}" in cmdline(pid)
    ]

    os.kill(victim, signal.SIGKILL)
    expected = [o["text"] for o in engine.generate(PROMPTS[:6], GREEDY)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: generate(url, p)["text"], PROMPTS[:6]))
    assert outs == expected
    assert proc.poll() is None  # the other server goes on serving
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert survivors_after(list(family), timeout=30) == []
