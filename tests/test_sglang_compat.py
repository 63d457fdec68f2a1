"""SGLang's own client tools against a spectral server, unchanged: the `sglang` frontend package
(0.5.3.post3: gen, select, roles, fork/join, run_batch, streaming), `bench_serving`, and the
request bodies sglang-router forwards; plus SGLang's request schema on /generate (fields
accepted while off, `n`, `stop_regex`, logprobs with token text) and the endpoints the tools
call. Outputs are checked against the offline Engine on the same text (greedy, float32)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.conftest import SERVER_API_KEY
from tests.server_utils import run_bench_serving, wait_idle_and_accounted

sgl = pytest.importorskip("sglang", reason="make test installs sglang==0.5.3.post3 (frontend)")

GREEDY = {"temperature": 0, "max_new_tokens": 12}


AUTH = {"Authorization": f"Bearer {SERVER_API_KEY}"}


@pytest.fixture(scope="module")
def server(fp32_server):
    yield fp32_server
    wait_idle_and_accounted(fp32_server, AUTH)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def endpoint(server):
    backend = sgl.RuntimeEndpoint(server, api_key=SERVER_API_KEY, chat_template_name="chatml")
    sgl.set_default_backend(backend)
    return backend


def post(http: httpx.Client, body: dict, status: int = 200):
    res = http.post("/generate", json=body)
    assert res.status_code == status, res.text
    return res.json()


def engine_text(engine, text: str, **params) -> str:
    return engine.generate(text, {**GREEDY, **params})["text"]


# ---- the request schema ----------------------------------------------------------------------


def test_the_frontends_gen_body_with_its_null_and_default_fields_is_served(http, engine_fp32):
    params = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 12,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    out = post(http, {"text": "The capital of France is", "sampling_params": params})
    assert out["text"] == engine_text(engine_fp32, "The capital of France is")


def test_the_routers_forwarded_body_is_served(http, engine_fp32):
    body = {
        "text": "One, two, three,",
        "model": None,
        "sampling_params": {**GREEDY, "sampling_seed": 7},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "lora_path": None,
        "logprob_start_len": -1,
    }
    assert post(http, body)["text"] == engine_text(engine_fp32, "One, two, three,")


@pytest.mark.parametrize(
    "field, value, where",
    [
        ("lora_path", "my-adapter", "lora_path"),
        ("image_data", "http://example.com/cat.png", "image_data"),
        ("return_hidden_states", True, "return_hidden_states"),
        ("sampling_params", {"regex": "(unclosed"}, "regex"),
        ("sampling_params", {"regex": "(?=look)ahead"}, "regex"),
        ("sampling_params", {"json_schema": '{"type": "nonsense"}'}, "json_schema"),
        ("sampling_params", {"json_schema": {"type": "object"}}, "json_schema"),
        ("sampling_params", {"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ("sampling_params", {"regex": "a", "json_schema": '{"type": "object"}'}, "json_schema"),
        ("sampling_params", {"logit_bias": {"5": 1.0}}, "logit_bias"),
        ("sampling_params", {"stop_regex": "(unclosed"}, "stop_regex"),
        ("unheard_of", 1, "unheard_of"),
    ],
)
def test_a_field_that_is_invalid_or_not_supported_is_a_400_naming_it(http, field, value, where):
    res = http.post("/generate", json={"text": "Hi", field: value}, timeout=30)
    assert res.status_code == 400
    error = res.json()["error"]
    assert where in error["param"] and where in error["message"]


def test_n_samples_per_prompt_come_back_prompt_by_prompt(http, engine_fp32):
    prompts = ["Red, green,", "Monday, Tuesday,"]
    greedy = post(http, {"text": prompts, "sampling_params": {**GREEDY, "n": 2}})
    expected = [engine_text(engine_fp32, p) for p in prompts]
    assert [o["text"] for o in greedy] == [expected[0], expected[0], expected[1], expected[1]]
    sampled = post(
        http,
        {"text": "Tell me a word:", "sampling_params": {"n": 3, "seed": 5, "max_new_tokens": 8}},
    )
    assert isinstance(sampled, list) and len(sampled) == 3
    assert len({tuple(o["output_ids"]) for o in sampled}) == 3  # each its own seed


def test_stop_regex_ends_the_output_at_the_first_match(http, engine_fp32):
    full = engine_text(engine_fp32, "Count: 1, 2, 3,", max_new_tokens=24)
    out = post(
        http,
        {
            "text": "Count: 1, 2, 3,",
            "sampling_params": {**GREEDY, "max_new_tokens": 24, "stop_regex": r" [5-9],"},
        },
    )
    match = re.search(r" [5-9],", full)
    assert match is not None, full
    assert out["text"] == full[: match.start()]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r" [5-9],"}


def test_logprobs_in_sglangs_shape_with_token_text(http, engine_fp32, tokenizer):
    text = "The quick brown fox jumps over"
    ids = tokenizer(text)["input_ids"]
    body = {
        "text": [text],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 2,
    }
    [out] = post(http, body)
    meta = out["meta_info"]
    assert meta["output_token_logprobs"] == []  # present even when empty
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[2:]
    assert [e[2] for e in entries] == [tokenizer.decode([t]) for t in ids[2:]]
    assert entries[0][0] is None
    oracle = engine_fp32.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=2,
    )["meta_info"]["input_token_logprobs"]
    assert [e[0] for e in entries[1:]] == pytest.approx([e[0] for e in oracle[1:]], abs=1e-4)
    scored = [e[0] for e in entries[1:]]
    assert meta["normalized_prompt_logprob"] == pytest.approx(sum(scored) / len(scored))
    # logprob_start_len left at -1: only the last prompt token (without a logprob), as SGLang
    plain = post(http, {"text": text, "sampling_params": GREEDY, "return_logprob": True})
    assert plain["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]
    assert len(plain["meta_info"]["output_token_logprobs"]) == len(plain["output_ids"])


def test_a_streamed_batch_tags_each_chunk_with_its_index(http, engine_fp32):
    prompts = ["Apples are", "The ocean is"]
    body = {"text": prompts, "sampling_params": GREEDY, "stream": True}
    last: dict[int, str] = {}
    with http.stream("POST", "/generate", json=body) as res:
        assert res.status_code == 200
        for line in res.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                last[chunk["index"]] = chunk["text"]  # cumulative
    assert [last[0], last[1]] == [engine_text(engine_fp32, p) for p in prompts]


def test_the_routers_forwarded_openai_bodies_are_served(http, engine_fp32, tokenizer):
    prompt = "Three primary colors are"
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
        "min_tokens": 0,
    }
    res = http.post("/v1/completions", json=body, timeout=60)
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["text"] == engine_text(engine_fp32, prompt)
    messages = [{"role": "user", "content": "Say hi."}]
    chat_body = {
        "model": "smollm2",
        "messages": messages,
        "max_completion_tokens": 12,
        "temperature": 0,
        "logprobs": False,
        "continue_final_message": False,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "ignore_eos": False,
        "no_stop_trim": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    }
    res = http.post("/v1/chat/completions", json=chat_body, timeout=60)
    assert res.status_code == 200, res.text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected = engine_fp32.generate(input_ids=ids, sampling_params=GREEDY)["text"]
    assert res.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize(
    "route, extra, param",
    [
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"regex": "[a-z"}, "regex"),
        (
            "/v1/completions",
            {"regex": "a", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": False}}, "chat_template"),
        ("/v1/completions", {"lora_path": "adapter"}, "lora_path"),
    ],
)
def test_openai_routes_refuse_extensions_they_cannot_honour(http, route, extra, param):
    body = {"model": "smollm2", "max_tokens": 4, **extra}
    body |= (
        {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {"prompt": "Hi"}
    )
    res = http.post(route, json=body, timeout=30)
    assert res.status_code == 400 and param in res.json()["error"]["param"], res.text


def test_the_openai_routes_honour_sglangs_sampling_extensions(http, engine_fp32):
    prompt = "Count: 1, 2, 3,"
    full = engine_text(engine_fp32, prompt, max_new_tokens=24)
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    res = http.post("/v1/completions", json={**body, "stop_regex": r" [5-9],"}, timeout=60)
    assert res.json()["choices"][0]["text"] == full[: re.search(r" [5-9],", full).start()]
    eos = engine_fp32.tokenizer.eos_token_id
    res = http.post(
        "/v1/completions",
        json={**body, "prompt": "Say yes.", "min_tokens": 20, "stop_token_ids": [eos]},
        timeout=60,
    )
    assert res.json()["usage"]["completion_tokens"] >= 20


def test_the_endpoints_sglangs_tools_call(http):
    info = http.get("/server_info").json()
    assert info == {**info, "tp_size": 1, "dp_size": 1, "served_model_name": "smollm2"}
    assert isinstance(info["max_total_tokens"], int) and "internal_states" in info
    assert http.get("/get_server_info").json()["tp_size"] == 1
    model = http.get("/model_info").json()
    assert model["model_path"] == "smollm2" and model["architectures"] == ["LlamaForCausalLM"]
    assert http.get("/get_model_info").json() == model
    [load] = http.get("/get_load").json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert http.get("/flush_cache").status_code == 200
    assert http.post("/flush_cache").status_code == 200


# ---- the sglang frontend package -------------------------------------------------------------


@sgl.function
def qa(s, question):
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=12, stop="\n", temperature=0)


def test_frontend_gen_equals_the_engine_on_the_same_text(endpoint, engine_fp32):
    state = qa.run(question="What is the capital of Italy?")
    prefix = "Question: What is the capital of Italy?\nAnswer:"
    assert state.text() == prefix + state["answer"]
    assert state["answer"] == engine_text(engine_fp32, prefix, stop=["\n"])


@sgl.function
def chat(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("reply", max_tokens=12, temperature=0))


def test_frontend_roles_render_chatml_and_continue_like_the_engine(endpoint, engine_fp32):
    state = chat.run(question="Name a color.")
    text = state.text()
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    prefix = text[: text.rindex(state["reply"])]
    assert state["reply"] == engine_text(engine_fp32, prefix)


@sgl.function
def pick(s, question, choices):
    s += question + " Answer:"
    s += sgl.select("choice", choices=choices)


SELECTS = [
    ("Is the sky blue on a clear day? Yes or no?", [" yes", " no"]),
    ("The opposite of hot is", [" cold", " warm", " purple"]),
]


@pytest.mark.parametrize("question, choices", SELECTS)
def test_frontend_select_agrees_with_spectrals_own_dsl(endpoint, server, question, choices):
    import spectral as spectral_dsl

    theirs = pick.run(question=question, choices=choices)["choice"]

    @spectral_dsl.function
    def ours(s):
        s += question + " Answer:"
        s += spectral_dsl.select("choice", choices=choices)

    mine = ours.run(backend=spectral_dsl.RuntimeEndpoint(server, SERVER_API_KEY))["choice"]
    assert theirs == mine and theirs in choices


@sgl.function
def branches(s):
    s += "List two fruits:\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"{i + 1}." + sgl.gen("item", max_tokens=6, stop="\n", temperature=0)
    forks.join()
    s += "Done: " + forks[0]["item"] + " and " + forks[1]["item"]


def test_frontend_fork_and_join(endpoint, engine_fp32):
    state = branches.run()
    first = engine_text(engine_fp32, "List two fruits:\n1.", max_new_tokens=6, stop=["\n"])
    second = engine_text(engine_fp32, "List two fruits:\n2.", max_new_tokens=6, stop=["\n"])
    assert state.text().endswith(f"Done: {first} and {second}")


def test_frontend_run_batch_and_streaming(endpoint, engine_fp32):
    questions = ["What is 2+2?", "Name a planet.", "What color is grass?"]
    states = qa.run_batch([{"question": q} for q in questions])
    for q, state in zip(questions, states):
        prefix = f"Question: {q}\nAnswer:"
        assert state["answer"] == engine_text(engine_fp32, prefix, stop=["\n"])
    streamed = qa.run(question=questions[0], stream=True)
    pieces = list(streamed.text_iter("answer"))
    assert "".join(pieces) == states[0]["answer"] and len(pieces) > 1


# ---- bench_serving ---------------------------------------------------------------------------


def test_bench_serving_reports_every_request_successful(server, default_model_dir, tmp_path):
    out = tmp_path / "bench.jsonl"
    [report] = run_bench_serving(server, default_model_dir, out, SERVER_API_KEY)
    assert report["completed"] == 8 and report["total_output_tokens"] == 8 * 8
