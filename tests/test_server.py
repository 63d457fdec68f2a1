"""A real server on loopback: the official openai client, the native API, concurrency with
disconnects, bad input, and process lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from tests.conftest import SERVER_API_KEY
from tests.gguf_models import write_foreign_gguf
from tests.server_utils import (
    descendants,
    wait_idle_and_accounted,
)

API_KEY = SERVER_API_KEY


@pytest.fixture(scope="module")
def server(fp32_server):
    return fp32_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY)


HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def engine_greedy(engine, ids: list[int], n: int) -> dict:
    return engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": n})


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_chat_equals_the_offline_engine(client, engine_fp32, tokenizer):
    messages = [{"role": "user", "content": "Name a fruit."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = engine_greedy(engine_fp32, list(ids), 20)
    res = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=20, temperature=0
    )
    assert res.choices[0].message.content == expected["text"]
    assert res.usage.prompt_tokens == len(ids)
    assert res.usage.completion_tokens == expected["meta_info"]["completion_tokens"]
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    assert chunks[-1].usage.completion_tokens == expected["meta_info"]["completion_tokens"]


def test_completions_plain_stream_echo_logprobs(client, engine_fp32, tokenizer):
    prompt = "The three primary colors are"
    expected = engine_greedy(engine_fp32, tokenizer(prompt)["input_ids"], 12)
    res = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert res.choices[0].text == expected["text"]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
    )
    assert streamed == expected["text"]
    echo = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=12, temperature=0, echo=True
    )
    assert echo.choices[0].text == prompt + expected["text"]
    lp = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 5 and all(v <= 0 for v in logprobs.token_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_completions_echo_with_logprobs_scores_the_prompt(client, hf_model, tokenizer):
    prompt = "Water boils at one hundred degrees"
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], -1)
    expected = [logprobs[p - 1, ids[p]].item() for p in range(1, len(ids))]
    res = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    got = res.choices[0].logprobs
    assert res.choices[0].text == prompt
    assert "".join(got.tokens) == prompt and got.token_logprobs[0] is None
    assert max(abs(g - e) for g, e in zip(got.token_logprobs[1:], expected)) < 1e-4
    assert got.text_offset[: len(ids)] == sorted(got.text_offset[: len(ids)])


def test_native_generate_matches_and_streams(server, engine_fp32, tokenizer):
    ids = tokenizer("Once upon a time")["input_ids"]
    expected = engine_greedy(engine_fp32, ids, 10)
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    res = httpx.post(server + "/generate", json=body, headers=HEADERS, timeout=60).json()
    assert res["output_ids"] == expected["output_ids"] and res["text"] == expected["text"]
    with httpx.stream(
        "POST", server + "/generate", json={**body, "stream": True}, headers=HEADERS, timeout=60
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) == 11


def test_a_stream_sends_its_first_token_at_once_then_every_stream_interval(server, tokenizer):
    """A request's stream_interval: its first token at once, then every 4, then the rest when
    it finishes (the server's default, 1, streams every token: the test above)."""
    ids = tokenizer("Once upon a time")["input_ids"]
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "stream_interval": 4}
    body = {"input_ids": ids, "sampling_params": params, "stream": True}
    with httpx.stream("POST", server + "/generate", json=body, headers=HEADERS, timeout=60) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert [len(e["output_ids"]) for e in events] == [1, 5, 9, 10]


def test_news_goes_out_per_stream_interval_and_at_the_end_without_a_stream():
    """The scheduler process's rule: a stream's first token, then every interval (the
    request's own over the server's); a request that does not stream, only when finished."""
    from spectral.core.req import FinishReason, Req
    from spectral.sampling_params import SamplingParams
    from spectral.server.scheduler_process import news_due

    def due(stream: bool, own: int | None, sent: int, out: int, done: bool = False) -> bool:
        req = Req("r", [1], SamplingParams(stream_interval=own), stream=stream)
        req.output_ids = list(range(out))
        req.finished_reason = FinishReason("length") if done else None
        return news_due(req, sent, 3)

    assert [due(True, None, 0, 1), due(True, None, 1, 3), due(True, None, 1, 4)] == [1, 0, 1]
    assert [due(True, 5, 1, 4), due(True, 5, 1, 6), due(True, 1, 6, 7)] == [0, 1, 1]
    assert [due(False, None, 0, 1), due(False, 1, 0, 9), due(False, None, 0, 9, True)] == [0, 0, 1]
    assert due(True, 5, 1, 2, done=True)


def wait_for_no_leaks(server: str, timeout: float = 20.0) -> dict:
    return wait_idle_and_accounted(server, HEADERS, timeout)


def test_32_streaming_clients_with_a_quarter_disconnecting(server):
    async def one(i: int, http: httpx.AsyncClient) -> int:
        body = {
            "text": f"Story number {i}:",
            "stream": True,
            "sampling_params": {
                "temperature": 0.8,
                "max_new_tokens": 24,
                "seed": i,
                "ignore_eos": True,
            },
        }
        chunks = 0
        async with http.stream("POST", server + "/generate", json=body, headers=HEADERS) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if i % 4 == 0 and chunks == 3:
                        return -1  # disconnect mid-stream
        return chunks

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(i, http) for i in range(32)))

    results = asyncio.run(run())
    assert results.count(-1) == 8
    assert all(r == 25 for r in results if r != -1)  # 24 tokens + [DONE]
    wait_for_no_leaks(server)
    assert httpx.get(server + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/chat/completions", b"{not json", "invalid request"),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            "role",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
            "max_tokens",
        ),
        ("/v1/completions", {"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"model": "m", "prompt": "x " * 9000}, "context length is 8192"),
        ("/generate", {"text": "x", "sampling_params": {"top_p": 0}}, "top_p: Input should be"),
        ("/generate", {"text": "x", "sampling_params": {"stream_interval": 0}}, "stream_interval"),
    ],
)
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(server, path, body, message):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    res = httpx.post(
        server + path, headers={**HEADERS, "content-type": "application/json"}, timeout=60, **kwargs
    )
    assert 400 <= res.status_code < 500
    assert message in res.json()["error"]["message"]
    ok = httpx.post(
        server + "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
        headers=HEADERS,
        timeout=60,
    )
    assert ok.status_code == 200


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded"])
def test_a_json_body_is_read_whatever_its_content_type(server, content_type):
    # `curl -d '{...}'` sends form-urlencoded; a hand-written client may send no header.
    body = b'{"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}'
    headers = {**HEADERS, **({"content-type": content_type} if content_type else {})}
    res = httpx.post(server + "/generate", content=body, headers=headers, timeout=60)
    assert res.status_code == 200 and res.json()["meta_info"]["completion_tokens"] == 2


def test_wrong_api_key_is_refused_but_health_is_open(server):
    res = httpx.get(server + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert res.status_code == 401 and "API key" in res.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    doc = httpx.get(server + "/openapi.json", headers=HEADERS, timeout=10).json()
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]


def test_a_worker_that_fails_to_start_stops_the_server_with_an_error(tiny_model_dir, tmp_path):
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    proc = subprocess.Popen(
        [sys.executable, "-m", "spectral.launch_server", "--model-path", str(broken)],
        start_new_session=True,
    )
    try:
        assert proc.wait(timeout=120) == 1
        assert descendants(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_model_of_an_unsupported_architecture_stops_the_server_at_start(tmp_path):
    foreign = write_foreign_gguf(tmp_path / "gemma3.gguf", "gemma3")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spectral.launch_server",
            "--model-path",
            str(foreign),
            "--model-cache-dir",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "GGUF architecture 'gemma3' is not supported; supported: llama, qwen2" in proc.stderr


def test_model_info_names_the_architecture_and_the_features_it_uses(server):
    info = httpx.get(f"{server}/get_model_info", headers=HEADERS).json()
    assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
    assert info["features"] == {  # SmolLM2-135M's config
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "rope_type": "default",
        "rope_theta": 100000.0,
        "num_heads": 9,
        "num_kv_heads": 3,
        "head_dim": 64,
        "sliding_window": None,
    }
    assert info["quantization"] == "none"  # a HF directory's weights, as stored


def test_server_info_reports_the_pools_bytes_and_every_caches_size_and_bound(server):
    """The KV pool (16384 tokens of SmolLM2-135M in float32: 30 layers x K, V x 3 heads x 64)
    is committed at start and reported in bytes; the grammar cache with its bounds."""
    from spectral.constrained import CACHE_BYTES, CACHE_ENTRIES

    info = httpx.get(f"{server}/get_server_info", headers=HEADERS).json()
    assert info["memory"]["kv_pool"] == {"bytes": 30 * 2 * 16385 * 3 * 64 * 4, "committed": True}
    grammars = info["caches"]["grammars"]
    assert grammars["max_entries"] == CACHE_ENTRIES and grammars["max_bytes"] == CACHE_BYTES
    assert 0 <= grammars["bytes"] <= CACHE_BYTES and 0 <= grammars["entries"] <= CACHE_ENTRIES


def test_a_non_streaming_client_that_gives_up_frees_its_request(server):
    body = {
        "text": "Tell me everything.",
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    before = wait_for_no_leaks(server)["stats"]["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/generate", json=body, headers=HEADERS, timeout=1.0)
    info = wait_for_no_leaks(server)
    assert info["stats"]["generated_tokens"] - before < 1000
    assert info["server_args"]["max_total_tokens"] == 16384 and "api_key" not in info["server_args"]


def test_metrics_expose_counters_histograms_and_gauges(server):
    httpx.post(
        server + "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 3}},
        headers=HEADERS,
        timeout=60,
    )
    text = httpx.get(server + "/metrics", headers=HEADERS, timeout=10).text
    for name in (
        "spectral:num_requests_total",
        "spectral:prompt_tokens_total",
        "spectral:generation_tokens_total",
        "spectral:time_to_first_token_seconds_bucket",
        "spectral:inter_token_latency_seconds_bucket",
        "spectral:num_running_reqs",
        "spectral:num_queue_reqs",
        "spectral:cache_hit_rate",
    ):
        assert name in text
    requests = [ln for ln in text.splitlines() if ln.startswith("spectral:num_requests_total")]
    assert float(requests[0].split()[-1]) >= 1


def test_generate_returns_input_token_logprobs(server, tokenizer):
    ids = tokenizer("Roses are red, violets are blue")["input_ids"]
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 2,
        "sampling_params": {"max_new_tokens": 1},
    }
    res = httpx.post(server + "/generate", json=body, headers=HEADERS, timeout=60).json()
    got = res["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[2:]
    assert got[0][0] is None and all(lp <= 0 for lp, _, _ in got[1:])
