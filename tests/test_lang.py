"""The frontend DSL (`import spectral as sgl`) against a real server on loopback: programs with
gen, select, roles, fork, streaming and run_batch on both backends, and the errors a user can
act on. Greedy (temperature 0) in float32 wherever outputs are compared."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

import spectral as sgl
from spectral.lang import BackendError
from tests.conftest import SERVER_API_KEY
from tests.server_utils import free_port

API_KEY = SERVER_API_KEY
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(fp32_server):
    return fp32_server


@pytest.fixture(scope="module")
def backend(server) -> sgl.RuntimeEndpoint:
    endpoint = sgl.RuntimeEndpoint(server, api_key=API_KEY)
    sgl.set_default_backend(endpoint)
    return endpoint


@pytest.fixture(scope="module")
def openai_backend(server) -> sgl.OpenAI:
    return sgl.OpenAI("default", base_url=server + "/v1", api_key=API_KEY)


def generate(url: str, body: dict) -> dict | list:
    response = httpx.post(url + "/generate", json=body, headers=HEADERS, timeout=120)
    response.raise_for_status()
    return response.json()


FEW_SHOT = (
    "Q: What is the capital of Germany?\nA: Berlin\n"
    "Q: What is the capital of Italy?\nA: Rome\n"
    "Q: What is the capital of Japan?\nA: Tokyo\n"
)


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")


@sgl.function
def two_turn_chat(s):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user("Name a fruit.")
    s += sgl.assistant(sgl.gen("first", max_tokens=10))
    s += sgl.user_begin() + "Name a vegetable." + sgl.user_end()
    s += sgl.assistant_begin()
    s += sgl.gen("second", max_tokens=10)
    s += sgl.assistant_end()


TRUTH_PROMPT = "Claim: Water is wet.\nIs the claim True, False or Unknown?\nAnswer: "


@sgl.function
def judge(s):
    s += TRUTH_PROMPT + sgl.select("verdict", choices=["True", "False", "Unknown"])


# ---- programs on the native API ------------------------------------------------------------


def test_few_shot_qa_answers_in_the_pattern_of_the_examples(backend, server):
    state = few_shot_qa.run(question="What is the capital of France?", temperature=0)

    assert state["answer"] == " Paris"
    prompt = FEW_SHOT + "Q: What is the capital of France?\nA:"
    assert state.text() == prompt + " Paris"
    direct = generate(
        server,
        {
            "text": prompt,
            "sampling_params": {"max_new_tokens": 8, "stop": ["\n"], "temperature": 0},
        },
    )
    assert direct["text"] == state["answer"]
    assert state.get_meta_info("answer")["finish_reason"] == {"type": "stop", "matched": "\n"}


def test_two_turn_chat_renders_chatml_and_continues_like_the_chat_api(backend, openai_backend):
    state = two_turn_chat.run(temperature=0)

    first, second = state["first"], state["second"]
    assert first and second
    assert state.messages() == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Name a vegetable."},
        {"role": "assistant", "content": second},
    ]
    assert state.text() == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nName a fruit.<|im_end|>\n"
        f"<|im_start|>assistant\n{first}<|im_end|>\n"
        "<|im_start|>user\nName a vegetable.<|im_end|>\n"
        f"<|im_start|>assistant\n{second}<|im_end|>\n"
    )
    # The server's /v1/chat/completions applies the model's own template to the same turns.
    via_chat_api = two_turn_chat.run(temperature=0, backend=openai_backend)
    assert via_chat_api["first"] == first
    assert via_chat_api["second"] == second


def test_select_picks_the_choice_with_the_best_mean_token_logprob(backend, server, tokenizer):
    state = judge.run()

    choices = ["True", "False", "Unknown"]
    # Independently: score each full text from its first token, and find where the choice's
    # tokens begin with the local tokenizer ("Answer: " + "True" ends in " True", not " ").
    prompt_ids = tokenizer(TRUTH_PROMPT)["input_ids"]
    expected = []
    for choice in choices:
        out = generate(
            server,
            {
                "text": TRUTH_PROMPT + choice,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        )
        entries = out["meta_info"]["input_token_logprobs"]
        start = next(i for i, (_, tok, _) in enumerate(entries) if prompt_ids[i : i + 1] != [tok])
        expected.append(sum(lp for lp, _, _ in entries[start:]) / (len(entries) - start))

    scores = state.get_meta_info("verdict")["normalized_prompt_logprobs"]
    assert scores == pytest.approx(expected, abs=1e-3)
    assert state["verdict"] == choices[max(range(3), key=lambda i: expected[i])]
    assert state.text() == TRUTH_PROMPT + state["verdict"]


def test_gen_with_choices_is_a_select(backend):
    @sgl.function
    def judge_with_gen(s):
        s += TRUTH_PROMPT + sgl.gen("verdict", choices=["True", "False", "Unknown"])

    assert judge_with_gen.run()["verdict"] == judge.run()["verdict"]


def test_fork_runs_three_branches_on_the_cached_prefix_and_join_gathers_them(backend):
    @sgl.function
    def three_ideas(s):
        s += "Three ways to spend a rainy afternoon at home, one per line:\n"
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f"{i + 1}." + sgl.gen("idea", max_tokens=6, stop="\n")
        forks.join()
        s += "Done."

    state = three_ideas.run(temperature=0)

    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == 3
    assert all(isinstance(idea, str) and idea for idea in ideas)
    assert state.text() == "Three ways to spend a rainy afternoon at home, one per line:\nDone."
    branches = state.get_meta_info("idea")["branches"]
    assert all(meta["cached_tokens"] >= 10 for meta in branches)


def test_fork_branches_keep_their_own_text(backend):
    @sgl.function
    def branches(s):
        s += "Colors:"
        forks = s.fork(2)
        forks[0] += " red"
        forks[1] += " blue"
        forks.join("concate_and_append")

    assert branches.run().text() == "Colors: red blue"


def test_streaming_yields_pieces_that_add_up_to_the_final_text(backend):
    @sgl.function
    def story(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("Tell me a story about a cat.")
        s += sgl.assistant(sgl.gen("story", max_tokens=12))

    state = story.run(temperature=0, stream=True)
    pieces = list(state.text_iter())

    assert len(pieces) > 2
    assert "".join(pieces) == state.text()
    assert "".join(state.text_iter("story")) == state["story"]
    assert state.text() == story.run(temperature=0).text()


def test_run_batch_prefills_the_shared_prefix_once_for_sixteen_programs(backend, server):
    @sgl.function
    def add(s, a, b):
        s += sgl.system("You add numbers.\n" + FEW_SHOT.replace("\n", " ") * 2)
        s += sgl.user(f"What is {a} plus {b}?")
        s += sgl.assistant(sgl.gen("sum", max_tokens=4))

    shared = "<|im_start|>system\nYou add numbers.\n" + FEW_SHOT.replace("\n", " ") * 2
    shared_tokens = generate(server, {"text": shared, "sampling_params": {"max_new_tokens": 0}})[
        "meta_info"
    ]["prompt_tokens"]
    backend.flush_cache()  # that request cached the prefix: run_batch must do it itself
    before = backend.get_server_info()["stats"]["cached_tokens"]

    states = add.run_batch([{"a": i, "b": 100 + i} for i in range(16)], temperature=0)

    assert [f"What is {i} plus {100 + i}?" in s.text() for i, s in enumerate(states)] == [True] * 16
    # run_batch prefilled the prefix before the programs started, so every one finds it cached
    # (the last token or two of the prefix may tokenize differently inside the full prompt).
    cached = [s.get_meta_info("sum")["cached_tokens"] for s in states]
    assert all(c >= shared_tokens - 2 for c in cached), cached
    after = backend.get_server_info()["stats"]["cached_tokens"]
    assert after - before >= 16 * (shared_tokens - 2)


def test_programs_compose_and_calling_one_outside_a_program_runs_it(backend):
    @sgl.function
    def greet(s, name):
        s += f"Hello, {name}."

    @sgl.function
    def letter(s):
        greet(s, "Ada")
        s += " Bye."

    assert letter().text() == "Hello, Ada. Bye."


# ---- the OpenAI backend on the server's /v1 --------------------------------------------------


def test_openai_backend_gen_and_select_on_the_chat_api(openai_backend, backend):
    @sgl.function
    def yes_no(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("Is the sky blue? Answer yes or no.")
        s += sgl.assistant(sgl.select("answer", ["yes", "no"]))
        s += sgl.user("Name a color.")
        s += sgl.assistant(sgl.gen("color", max_tokens=8))

    state = yes_no.run(temperature=0, backend=openai_backend)

    assert state["answer"] in ("yes", "no")
    generated = state.get_meta_info("answer")["generated"]
    assert generated.strip().lower().startswith(state["answer"])
    assert state["color"]
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[2]["content"] == state["answer"]


def test_openai_backend_completion_model_matches_the_native_api(server, backend):
    completion = sgl.OpenAI(
        "default", base_url=server + "/v1", api_key=API_KEY, is_chat_model=False
    )

    via_openai = few_shot_qa.run(
        question="What is the capital of Spain?", temperature=0, backend=completion
    )
    via_native = few_shot_qa.run(question="What is the capital of Spain?", temperature=0)

    assert via_openai["answer"] == via_native["answer"]

    # select scores the choices by prompt logprobs, as the native API does.
    scored = judge.run(backend=completion)
    native = judge.run()
    assert scored.get_meta_info("verdict")["method"] == "logprobs"
    assert scored["verdict"] == native["verdict"]
    assert scored.get_meta_info("verdict")["normalized_prompt_logprobs"] == pytest.approx(
        native.get_meta_info("verdict")["normalized_prompt_logprobs"], abs=1e-3
    )


def test_openai_chat_backend_needs_gen_to_open_the_assistant_turn(openai_backend):
    @sgl.function
    def misplaced(s):
        s += sgl.user("Hi " + sgl.gen("x", max_tokens=2))

    with pytest.raises(ValueError, match=r"gen\(\) is inside user\(\).*assistant\(gen"):
        misplaced.run(backend=openai_backend)


# ---- packaging --------------------------------------------------------------------------------


def test_the_dsl_imports_nothing_from_the_runtime():
    code = (
        "import sys, spectral as sgl\n"
        "sgl.function, sgl.RuntimeEndpoint, sgl.OpenAI\n"
        "runtime = [m for m in sys.modules if m.startswith('spectral.')\n"
        "           and not m.startswith('spectral.lang')]\n"
        "assert not runtime, runtime\n"
        "assert 'torch' not in sys.modules and 'openai' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- errors a user can act on ----------------------------------------------------------------


def test_unknown_variable_names_the_known_ones(backend):
    @sgl.function
    def asks_for_the_wrong_name(s):
        s += "Hello," + sgl.gen("greeting", max_tokens=2)
        s["nope"]

    with pytest.raises(KeyError, match=r"no variable 'nope'.*known variables: 'greeting'"):
        asks_for_the_wrong_name.run(temperature=0)


def test_unreachable_backend_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"

    with pytest.raises(ConnectionError, match=f"cannot reach the server at {url}"):
        sgl.RuntimeEndpoint(url)


def test_missing_api_key_says_how_to_pass_one(server):
    with pytest.raises(BackendError, match=r"HTTP 401.*api_key="):
        sgl.RuntimeEndpoint(server)


def test_select_without_choices_is_rejected():
    with pytest.raises(ValueError, match=r"select\('verdict'\) needs at least one choice"):
        sgl.select("verdict", [])
    with pytest.raises(ValueError, match="needs at least one choice"):
        sgl.gen("verdict", choices=[])


PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gen_with_a_regex_fully_matches_it_on_both_backends(backend, openai_backend, temperature):
    @sgl.function
    def phone(s):
        s += "My phone number is " + sgl.gen("number", regex=PHONE, max_tokens=24)

    state = phone.run(temperature=temperature)
    assert re.fullmatch(PHONE, state["number"]), state["number"]

    @sgl.function
    def chat_phone(s):
        s += sgl.user("Make up a phone number.")
        s += sgl.assistant(sgl.gen("number", regex=PHONE, max_tokens=24))

    state = chat_phone.run(backend=openai_backend, temperature=temperature)
    assert re.fullmatch(PHONE, state["number"]), state["number"]


def test_a_regex_xgrammar_cannot_use_is_reported_by_the_server(backend):
    @sgl.function
    def lookahead(s):
        s += "x" + sgl.gen("y", regex=r"(?=a)a", max_tokens=4)

    with pytest.raises(BackendError, match="Lookahead is not supported"):
        lookahead.run()


def test_mismatched_roles_are_reported(backend):
    @sgl.function
    def unbalanced(s):
        s += sgl.user_begin() + "hi" + sgl.assistant_end()

    with pytest.raises(
        ValueError, match=r"assistant_end\(\) without a matching .*user role is open"
    ):
        unbalanced.run()
