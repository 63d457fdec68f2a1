"""Requests from a hostile client against a real server: every class of bad input gets a 4xx
naming the field, failures inside a child process fail only their request, bounded work keeps
everyone else served. After each, the same processes run and the KV cache is accounted for.

The server runs a tiny random model (with sharp distributions, so greedy outputs do not
depend on the batch) with a 64-token context and fault injection on (requests whose id starts with
`fault-<stage>` fail in that stage)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.fuzz import fuzz
from tests.server_utils import (
    peak_rss_kib,
    server_processes,
    start_server,
    stop_server,
    survivors_after,
    wait_idle_and_accounted,
)

MAX_SEQUENCES = 24
MAX_RUNNING = 4
CONTEXT = 64  # so that whatever a fuzzer asks for is served in a moment
BODY_LIMIT = 4 * 2**20
FUZZ_EXAMPLES = 15
COMPILE_TIMEOUT_S = 0.5  # a 20,000-value enum takes seconds to compile
GRAMMAR_CACHE_MIB = 3  # a 300-value enum's schema compiles to ~2 MB


@pytest.fixture(scope="module")
def hostile(peaky_model_dir):
    proc, url = start_server(
        "--model-path",
        peaky_model_dir,
        "--dtype",
        "float32",
        "--max-total-tokens",
        "16384",
        "--context-length",
        str(CONTEXT),
        "--max-running-requests",
        str(MAX_RUNNING),
        "--max-request-sequences",
        str(MAX_SEQUENCES),
        "--max-request-bytes",
        str(BODY_LIMIT),
        "--fault-injection",
        "detokenizer,scheduler,worker",
        "--grammar-compile-timeout",
        str(COMPILE_TIMEOUT_S),
        "--grammar-cache-mib",
        str(GRAMMAR_CACHE_MIB),
    )
    try:
        before = server_processes(proc)
        assert len(before) >= 3  # the server, its detokenizer and scheduler (holding the worker)
    except BaseException:  # a server the module cannot use is stopped, not left running
        stop_server(proc)
        raise
    yield proc, url
    if proc.poll() is not None:  # ended by the module's last test, which kills its scheduler
        return
    after = server_processes(proc)
    stop_server(proc)  # SIGTERM: every one of them must be gone
    assert after == before, "a process of the server died or was replaced"


@pytest.fixture
def server(hostile):
    """The server's URL; after the test it is idle, KV accounted, the same processes alive."""
    proc, url = hostile
    before = server_processes(proc)
    yield url
    wait_idle_and_accounted(url)
    assert server_processes(proc) == before
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def post(url: str, path: str, body, timeout: float = 60) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


def generate(text: str = "Hello", **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra}


def sampling(**params) -> dict:
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 4, **params}}


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


BIG = 2**64 + 1
# (path, body, the field the error must name) — each class of the issue, several variants.
HOSTILE = [
    # values that used to reach a child process unvalidated
    ("/generate", sampling(skip_special_tokens="no"), "sampling_params.skip_special_tokens"),
    ("/generate", sampling(skip_special_tokens=1), "sampling_params.skip_special_tokens"),
    ("/generate", sampling(ignore_eos="true"), "sampling_params.ignore_eos"),
    ("/generate", sampling(no_stop_trim=0), "sampling_params.no_stop_trim"),
    ("/generate", generate(return_logprob=True, top_logprobs_num=100_000), "top_logprobs_num"),
    ("/generate", generate(return_logprob=True, top_logprobs_num=-1), "top_logprobs_num"),
    ("/generate", sampling(stop_token_ids=[10**6]), "stop_token_ids"),
    ("/generate", {"input_ids": [1, 2, 10**6]}, "input_ids"),
    ("/generate", {"input_ids": [1, -5]}, "input_ids"),
    ("/v1/chat/completions", chat(top_logprobs=1000, logprobs=True), "top_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    # integers beyond 64 bits, non-finite floats, NaN-producing penalties
    ("/generate", sampling(seed=BIG), "sampling_params.seed"),
    ("/generate", sampling(top_k=BIG), "sampling_params.top_k"),
    ("/generate", sampling(max_new_tokens=BIG), "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [BIG]}, "input_ids"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": BIG}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, BIG]}, "prompt"),
    ("/v1/chat/completions", chat(seed=-BIG), "seed"),
    ("/generate", '{"text": "Hi", "sampling_params": {"temperature": 1e309}}', "temperature"),
    ("/generate", '{"text": "Hi", "sampling_params": {"top_p": NaN}}', "top_p"),
    ("/v1/completions", '{"prompt": "Hi", "temperature": -Infinity}', "temperature"),
    ("/generate", sampling(repetition_penalty=1e-300), "sampling_params.repetition_penalty"),
    ("/generate", sampling(repetition_penalty=0), "sampling_params.repetition_penalty"),
    ("/generate", sampling(temperature=True), "sampling_params.temperature"),
    # strings that do not encode as UTF-8 (lone surrogates)
    ("/generate", '{"text": "a\\ud800b"}', "text"),
    ("/generate", '{"text": ["ok", "\\udfff"]}', "text"),
    ("/generate", '{"text": "Hi", "sampling_params": {"stop": ["\\ud83d"]}}', "stop"),
    ("/generate", '{"text": "Hi", "rid": "\\ud800"}', "rid"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "content"),
    ("/v1/completions", '{"prompt": "\\udc00"}', "prompt"),
    # sizes: stop lists, stop strings, request ids, fan-out
    ("/generate", sampling(stop=["x"] * 10_000), "sampling_params.stop"),
    ("/generate", sampling(stop=["s"] * 33), "sampling_params.stop"),
    ("/generate", sampling(stop="y" * 300), "sampling_params.stop"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["z"] * 40}, "stop"),
    ("/generate", generate(rid="r" * 100_000), "rid"),
    ("/generate", generate(rid="r" * 300), "rid"),
    ("/v1/completions", {"prompt": ["Hi"] * 100, "n": 16}, "n"),
    ("/v1/chat/completions", chat(n=MAX_SEQUENCES + 1), "n"),
    ("/generate", {"text": ["Hi"] * (MAX_SEQUENCES + 1)}, "text"),
    # batches that do not line up, and bodies that are not JSON objects
    ("/generate", {"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ("/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ("/generate", {"text": "a", "rid": ["x", "y"]}, "rid"),
    ("/generate", {"text": "a", "input_ids": [1]}, "text"),
    ("/generate", b"{not json", None),
    ("/generate", b"[1, 2, 3]", None),
    ("/generate", b"", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 1.5}', "n"),
    ("/abort_request", {"rid": 5}, "rid"),
]


@pytest.mark.parametrize("path, body, field", HOSTILE)
def test_a_hostile_request_gets_a_4xx_naming_its_field(server, path, body, field):
    res = post(server, path, body)
    assert 400 <= res.status_code < 500, res.text
    error = res.json()["error"]
    assert error["code"] == res.status_code
    if field is not None:
        assert field in error["message"], error["message"]
        assert error["param"] is not None and field.split(".")[-1] in error["param"]
    assert len(res.content) < 2000  # a huge value is not echoed back


def test_a_refused_batch_element_runs_none_of_the_batch(server):
    before = httpx.get(server + "/get_server_info").json()["stats"]["prefill_tokens"]
    res = post(server, "/generate", {"input_ids": [[1, 2, 3], [4, 10**6], [5, 6]]})
    assert res.status_code == 400 and "prompt 1" in res.json()["error"]["message"]
    res = post(server, "/generate", {"text": ["fine", "y" * 60_000]})
    assert res.status_code == 400 and "text.1" in res.json()["error"]["message"]
    after = httpx.get(server + "/get_server_info").json()["stats"]["prefill_tokens"]
    assert after == before


def test_a_stream_refused_before_its_headers_gets_a_plain_400(server):
    with httpx.stream(
        "POST", server + "/generate", json={"input_ids": [1] * 100, "stream": True}, timeout=30
    ) as res:
        res.read()
    assert res.status_code == 400 and "context length" in res.json()["error"]["message"]


@pytest.mark.parametrize("stage", ["detokenizer", "scheduler", "worker"])
def test_a_failure_in_a_child_fails_only_its_request(server, stage):
    """The faulty request and three others arrive together (they share batches); the faulty
    one gets a 500 naming the stage, the others the same text as when run alone."""
    prompts = [f"Request {i} says" for i in range(3)]
    alone = [post(server, "/generate", generate(p)).json()["text"] for p in prompts]

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            bodies = [generate(p) for p in prompts] + [generate("Boom", rid=f"fault-{stage}-1")]
            return await asyncio.gather(*(http.post("/generate", json=b) for b in bodies))

    *ok, faulty = asyncio.run(run())
    assert faulty.status_code == 500
    assert (
        f"the {stage.replace('worker', 'model worker')} failed" in faulty.json()["error"]["message"]
    )
    assert [r.status_code for r in ok] == [200] * 3
    assert [r.json()["text"] for r in ok] == alone


@pytest.mark.parametrize("stage", ["detokenizer", "scheduler", "worker"])
def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event(server, stage):
    body = generate("Boom", rid=f"fault-{stage}-stream", stream=True)
    with httpx.stream("POST", server + "/generate", json=body, timeout=60) as res:
        lines = [ln for ln in res.iter_lines() if ln.startswith("data: ")]
    assert res.status_code == 200
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and '"code":500' in lines[-2]


def generated_tokens(server: str) -> int:
    return httpx.get(server + "/get_server_info").json()["stats"]["generated_tokens"]


def test_a_runtime_failure_in_a_batch_cancels_its_siblings(server):
    before = generated_tokens(server)
    body = {
        "text": ["one", "two", "three"],
        "rid": ["sib-1", "fault-worker-b", "sib-3"],
        "sampling_params": {"max_new_tokens": CONTEXT, "ignore_eos": True},
    }
    res = post(server, "/generate", body)
    assert res.status_code == 500 and "fault-worker-b" in res.json()["error"]["message"]
    # the siblings were aborted (their KV freed: checked by the fixture), not run to the end
    wait_idle_and_accounted(server)
    assert generated_tokens(server) - before < 2 * (CONTEXT - 2)


def test_health_stays_fast_while_a_50mb_body_is_refused(hostile, server):
    proc, _ = hostile
    http_pid = proc.pid
    peak_before = peak_rss_kib(http_pid)
    body = b'{"text": "' + b"a" * (50 * 2**20) + b'"}'
    results: dict[str, object] = {}

    def send(name, content):
        results[name] = httpx.post(server + "/generate", content=content, timeout=120)

    def chunks():  # no Content-Length: refused as soon as it passes the limit
        for i in range(0, len(body), 2**20):
            yield body[i : i + 2**20]

    health_times = []
    for name, content in (("sized", body), ("chunked", chunks())):
        sender = threading.Thread(target=send, args=(name, content))
        sender.start()
        while sender.is_alive():
            t = time.perf_counter()
            assert httpx.get(server + "/health", timeout=5).status_code == 200
            health_times.append(time.perf_counter() - t)
            time.sleep(0.05)
        sender.join()
        assert results[name].status_code == 413, results[name].text
        assert "max-request-bytes" in results[name].json()["error"]["message"]
    # a prompt within the body limit but longer than any context: refused before tokenizing
    res = post(server, "/generate", {"text": "word " * 700_000})
    assert res.status_code == 400 and "characters" in res.json()["error"]["message"]
    growth_mib = (peak_rss_kib(http_pid) - peak_before) / 1024
    print(
        f"\n/health max {max(health_times) * 1000:.0f} ms over {len(health_times)} calls; "
        f"HTTP process peak RSS grew {growth_mib:.1f} MiB"
    )
    assert max(health_times) < 1.0
    assert growth_mib < 40  # not the 50 MB body, let alone a copy of it


def test_a_small_request_is_served_beside_a_maximal_fan_out(server):
    """A batch of the most sequences a request may start holds every row; a 4-token request
    that arrives later still runs at once (the fan-out gives up a row), long before any of the
    fan-out's sequences could finish."""
    fan_out = {
        "text": [f"Story {i}:" for i in range(MAX_SEQUENCES)],
        "sampling_params": {"max_new_tokens": CONTEXT, "ignore_eos": True, "temperature": 0},
    }

    def stats() -> dict:
        return httpx.get(server + "/get_server_info").json()["stats"]

    before = stats()

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            big = asyncio.create_task(http.post("/generate", json=fan_out))
            while (await http.get("/get_server_info")).json()["requests"]["running"] < MAX_RUNNING:
                await asyncio.sleep(0.02)
            small = await http.post("/generate", json=generate("Quick", rid="small-one"))
            done_before = big.done()
            return small, done_before, await big

    small, done_before, big_res = asyncio.run(run())
    assert small.status_code == 200 and small.json()["meta_info"]["completion_tokens"] == 4
    assert big_res.status_code == 200 and len(big_res.json()) == MAX_SEQUENCES
    assert not done_before
    # The scheduler retracted a fan-out row for it instead of waiting for one to free up (the
    # pool has room for everything, so nothing else retracts here) ...
    assert stats()["retractions"] > before["retractions"]
    # ... and by its own clock served it sooner than the fan-out's first sequences took to
    # generate their CONTEXT tokens (waiting for a free row would have taken longer than that).
    first_done = min(out["meta_info"]["e2e_latency"] for out in big_res.json())
    assert small.json()["meta_info"]["e2e_latency"] < first_done


def test_compiled_grammars_are_kept_within_grammar_cache_mib(server):
    """Two schemas of ~2 MB compiled each: the first is forgotten to keep the cache within
    --grammar-cache-mib, which /get_server_info reports as its bound."""
    for salt in ("a", "b"):
        schema = {
            "type": "object",
            "properties": {"v": {"enum": [f"{salt}{i}" for i in range(300)]}},
        }
        params = {"max_new_tokens": 4, "json_schema": json.dumps(schema)}
        res = httpx.post(server + "/generate", json={"text": "Pick:", "sampling_params": params})
        assert res.status_code == 200, res.text
    grammars = httpx.get(server + "/get_server_info").json()["caches"]["grammars"]
    assert grammars["max_bytes"] == GRAMMAR_CACHE_MIB * 2**20
    assert 2**20 < grammars["bytes"] <= GRAMMAR_CACHE_MIB * 2**20  # one of them kept


def test_a_grammar_past_the_compile_timeout_gets_a_400_naming_the_limit(server):
    """A JSON schema with a 20,000-value enum compiles for seconds: its request is refused with
    a 400 naming --grammar-compile-timeout, and a plain request sent beside it is served."""
    schema = {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(20000)]}}}
    params = {"max_new_tokens": 4, "json_schema": json.dumps(schema)}
    huge = {"text": "Pick:", "sampling_params": params}

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            refused = asyncio.create_task(http.post("/generate", json=huge))
            small = await http.post("/generate", json=generate("Quick", rid="beside-a-compile"))
            return await refused, small

    refused, small = asyncio.run(run())
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert f"longer than --grammar-compile-timeout ({COMPILE_TIMEOUT_S:g} s)" in message
    assert small.status_code == 200 and small.json()["meta_info"]["completion_tokens"] == 4


def test_the_openapi_document_is_typed_and_documents_400(server):
    doc = httpx.get(server + "/openapi.json").json()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            if method == "post":
                assert "400" in op["responses"], (method, path)
    schemas = doc["components"]["schemas"]
    sampling = schemas["SamplingParamsModel"]["properties"]
    assert sampling["skip_special_tokens"]["type"] == "boolean"
    assert sampling["seed"]["anyOf"][0]["type"] == "integer"
    assert sampling["temperature"]["minimum"] == 0
    generate_ok = doc["paths"]["/generate"]["post"]["responses"]["200"]["content"]
    assert set(generate_ok) == {"application/json", "text/event-stream"}


def test_schemathesis_finds_no_5xx_and_no_schema_mismatch(server):
    """A bounded fuzz of every operation (make fuzz runs a longer one); afterwards the server
    is idle with its KV accounted for and the same processes running (the fixture)."""
    code, output, counts = fuzz(server, examples=FUZZ_EXAMPLES)
    print(f"\nschemathesis, {FUZZ_EXAMPLES} cases per operation: {counts}")
    assert code == 0, output[-6000:]
    assert counts.get("generated", 0) >= FUZZ_EXAMPLES * 4


def test_last_a_killed_scheduler_stops_the_server_with_an_error(hostile):
    """The module's last test (it ends the module's server): the scheduler process, which
    holds the model worker (no process of the worker's own without --worker-process), SIGKILLed;
    the server exits with an error within seconds and every process of it is gone."""
    proc, _ = hostile
    family = server_processes(proc)
    assert not [cmd for cmd in family.values() if "spectral.server.worker_process" in cmd]
    schedulers = [pid for pid, cmd in family.items() if "spectral.server.scheduler_process" in cmd]
    assert len(schedulers) == 1
    os.kill(schedulers[0], signal.SIGKILL)
    try:
        assert proc.wait(timeout=10) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not [family[pid] for pid in survivors_after(list(family))]
