"""Structured outputs (regex, json_schema, ebnf through xgrammar) in plain decoding.

Oracles: transformers' model decoding greedily under xgrammar's own matcher and its own mask
kernel (not spectral's); xgrammar's `apply_token_bitmask_inplace` for spectral's mask. Outputs
sampled under grammars, plainly and speculatively: tests/test_structured_spec.py.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr  # the oracle's matcher and kernel

from spectral.constrained import allocate_bitmask, apply_bitmask
from spectral.worker.grammar_follower import GrammarFollower

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
INVENTORY = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "count": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["sku", "count"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "in_stock": {"type": "boolean"},
    },
    "required": ["items", "in_stock"],
}
SCHEMAS = [PERSON, INVENTORY, {"type": "array", "items": {"type": "number"}, "maxItems": 4}]
REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,2}\.",
    r"\d{4}-\d{2}-\d{2}",
]
COLORS = (
    'root ::= color | color ", " color | color ", " color ", " color\n'
    'color ::= "red" | "green" | "blue"'
)


def chat(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def oracle_greedy(hf_model, tokenizer, ids, kind, text, max_new_tokens, stop_ids) -> list[int]:
    """Greedy decoding by transformers under xgrammar's matcher and mask kernel."""
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=hf_model.config.vocab_size, stop_token_ids=stop_ids
    )
    compiler = xgr.GrammarCompiler(info)
    compiled = {
        "regex": compiler.compile_regex,
        "json_schema": lambda t: compiler.compile_json_schema(t, max_whitespace_cnt=16),
        "ebnf": compiler.compile_grammar,
    }[kind](text)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, hf_model.config.vocab_size)
    out: list[int] = []
    past, step = None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            res = hf_model(step, past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1].float()
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            token = int(logits.argmax())
            out.append(token)
            step = torch.tensor([[token]])
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
    return out


GREEDY_CASES = [
    ("Describe a person as JSON.", "json_schema", json.dumps(PERSON)),
    ("What is your phone number?", "regex", REGEXES[0]),
    ("Name some colors.", "ebnf", COLORS),
]


@pytest.mark.parametrize("question, kind, text", GREEDY_CASES)
def test_greedy_under_a_grammar_equals_transformers_under_xgrammar(
    engine_fp32, hf_model, tokenizer, question, kind, text
):
    ids = chat(tokenizer, question)
    out = engine_fp32.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 40, kind: text}
    )
    expected = oracle_greedy(
        hf_model, tokenizer, ids, kind, text, 40, list(engine_fp32.model.stop_token_ids)
    )
    assert out["output_ids"] == expected
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def check(kind: str, text: str, output: str) -> None:
    if kind == "regex":
        assert re.fullmatch(text, output), (text, output)
    else:
        jsonschema.validate(json.loads(output), json.loads(text))


def test_the_grammar_ends_the_request_even_with_ignore_eos(engine_fp32, tokenizer):
    out = engine_fp32.generate(
        input_ids=chat(tokenizer, "Yes or no?"),
        sampling_params={
            "temperature": 0,
            "max_new_tokens": 30,
            "regex": "(yes|no)",
            "ignore_eos": True,
        },
    )
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_max_new_tokens_before_the_grammar_ends_gives_length(engine_fp32, tokenizer):
    out = engine_fp32.generate(
        input_ids=chat(tokenizer, "Describe a person as JSON."),
        sampling_params={"temperature": 0, "max_new_tokens": 5, "json_schema": json.dumps(PERSON)},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


@pytest.mark.parametrize("path", ["cpu-kernels", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mask_sets_exactly_the_forbidden_logits_to_minus_infinity(dtype, path):
    """Against a bit-by-bit reading of the mask (token t is bit t % 32 of word t // 32), in C++
    and through torch; a vocabulary that ends inside a word."""
    from spectral.kernels.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels() if path == "cpu-kernels" else None
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # 31.25 words
    logits = torch.randn((5, vocab), generator=gen).to(dtype)
    mask = allocate_bitmask(5, vocab)
    mask[:] = torch.randint(-(2**31), 2**31 - 1, mask.shape, generator=gen, dtype=torch.int32)
    mask[3, 2:6] = 0  # whole words forbidden
    mask[4] = -1  # a row without a grammar
    expected = logits.clone()
    for row in range(5):
        for token in range(vocab):
            if not (int(mask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    got = apply_bitmask(logits.clone(), mask, kernels)
    assert torch.equal(got, expected)
    assert torch.equal(got[4], logits[4])


def test_a_prepared_follower_builds_its_compiler_once_on_a_thread_of_its_own(tokenizer):
    """The worker's follower, prepared when its process is ready, builds the grammar compiler
    on another thread (the first grammar round does not load it inside a step), once."""
    import threading

    from spectral.constrained import GrammarBackend
    from spectral.worker.grammar_follower import GrammarFollower

    built_on = []

    def make_backend() -> GrammarBackend:
        built_on.append(threading.get_ident())
        return GrammarBackend(tokenizer, 49152, [2])

    follower = GrammarFollower(make_backend)
    follower.backend.start()
    follower.backend.start()
    grammar = follower.follow("r1", ("regex", "ab+c"), [], [])
    assert grammar.accept(tokenizer.convert_tokens_to_ids("a"))
    follower.follow("r2", ("regex", "x"), [], [])
    assert len(built_on) == 1 and built_on[0] != threading.get_ident()


# ---- over HTTP -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(fp32_server):
    import openai

    from tests.conftest import SERVER_API_KEY

    return openai.OpenAI(base_url=fp32_server + "/v1", api_key=SERVER_API_KEY)


def test_openai_response_format_json_schema_and_json_object(client):
    messages = [{"role": "user", "content": "Give me a person as JSON."}]
    res = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=120,
        temperature=0.8,
        seed=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    jsonschema.validate(json.loads(res.choices[0].message.content), PERSON)
    assert res.choices[0].finish_reason == "stop"
    res = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": 'What is 2+2? Answer as {"answer": ...}.'}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert res.choices[0].finish_reason == "stop", res.choices[0].message.content
    assert isinstance(json.loads(res.choices[0].message.content), dict)


def test_native_generate_and_openai_completions_take_sglangs_grammar_fields(fp32_server, client):
    import httpx

    from tests.conftest import SERVER_API_KEY

    body = {
        "text": "The date today is ",
        "sampling_params": {"temperature": 0.8, "max_new_tokens": 16, "regex": REGEXES[3]},
    }
    res = httpx.post(
        fp32_server + "/generate",
        json=body,
        headers={"Authorization": f"Bearer {SERVER_API_KEY}"},
        timeout=60,
    )
    assert re.fullmatch(REGEXES[3], res.json()["text"]), res.text
    res = client.completions.create(
        model="smollm2",
        prompt="Colors I like: ",
        max_tokens=16,
        temperature=0.8,
        extra_body={"ebnf": COLORS},
    )
    assert re.fullmatch(r"(red|green|blue)(, (red|green|blue)){0,2}", res.choices[0].text)


# ---- compiling off the scheduler's path ------------------------------------------------------


def test_a_grammar_compiles_while_the_others_decode_and_a_failed_compile_is_refused(
    peaky_model_dir, monkeypatch
):
    """A request waits in `compiling` while its grammar compiles on another thread; the running
    requests keep decoding meanwhile. It joins once compiled and follows its grammar; a grammar
    that fails to compile is refused with xgrammar's reason; nothing leaks."""
    import threading

    from spectral.constrained import GrammarBackend
    from spectral.core.req import Req
    from spectral.sampling_params import SamplingParams
    from tests.conftest import make_scheduler, scheduler_leaks

    release = threading.Event()
    compile_now = GrammarBackend._compile

    def held_compile(self, kind, text):
        if text == "(held|back)":
            release.wait(timeout=30)
        if text == "fails":
            raise RuntimeError("[10:00:00] /project/cpp/x.cc:1: no grammar for you")
        return compile_now(self, kind, text)

    monkeypatch.setattr(GrammarBackend, "_compile", held_compile)
    s = make_scheduler(peaky_model_dir)
    free = Req("free", [5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0.0))
    held = Req("held", [5, 6, 8], SamplingParams(max_new_tokens=12, regex="(held|back)"))
    bad = Req("bad", [5, 6, 9], SamplingParams(max_new_tokens=12, regex="fails"))
    for req in (free, bad, held):
        s.add_request(req)
    for _ in range(6):
        s.step()
    assert held in s.grammars.compiling and len(free.output_ids) >= 4
    assert s.grammars.take_rejected() == [
        ("bad", "regex: xgrammar cannot compile it: no grammar for you")
    ]
    release.set()
    while s.has_work:
        s.step()
    assert held.finished_reason.type == "stop" and free.finished_reason is not None
    assert s.grammars.backend().compile_later("regex", "(held|back)").done()
    assert held.output_ids[-1] == 2 and len(held.output_ids) <= 4
    assert scheduler_leaks(s) == []


def test_a_compile_past_the_timeout_is_refused_and_kept_when_it_ends(peaky_model_dir, monkeypatch):
    """A request whose grammar has not compiled within --grammar-compile-timeout is refused
    with a reason naming the limit, while the others decode; the compile goes on and, once it
    ends, a request with the same grammar joins at once. Compiles run on threads of the lowest
    priority (Linux: COMPILE_NICENESS)."""
    import os
    import sys
    import threading
    import time

    from spectral.constrained import COMPILE_NICENESS, GrammarBackend
    from spectral.core.req import Req
    from spectral.sampling_params import SamplingParams
    from tests.conftest import make_scheduler, scheduler_leaks

    release = threading.Event()
    niceness: list[int] = []
    compile_now = GrammarBackend._compile

    def slow_compile(self, kind, text):
        if sys.platform.startswith("linux"):
            niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        release.wait(timeout=30)
        return compile_now(self, kind, text)

    monkeypatch.setattr(GrammarBackend, "_compile", slow_compile)
    s = make_scheduler(peaky_model_dir, grammar_compile_timeout=0.3)
    free = Req("free", [5, 6, 7], SamplingParams(max_new_tokens=40, temperature=0.0))
    slow = Req("slow", [5, 6, 8], SamplingParams(max_new_tokens=12, regex="(held|back)"))
    s.add_request(free)
    s.add_request(slow)
    start = time.monotonic()
    rejected: list[tuple[str, str]] = []
    while not rejected and time.monotonic() - start < 10:
        s.step()
        rejected += s.grammars.take_rejected()
    waited = time.perf_counter() - slow.created_at  # the clock the timeout reads
    assert waited >= 0.3 and len(free.output_ids) > 0  # others decoded meanwhile
    assert rejected == [
        ("slow", "regex: compiling it took longer than --grammar-compile-timeout (0.3 s)")
    ]
    assert slow.finished_reason.type == "abort" and s.grammars.compiling == []
    release.set()
    compiled = s.grammars.backend().compile_later("regex", "(held|back)")
    compiled.result(timeout=30)
    again = Req("again", [5, 6, 9], SamplingParams(max_new_tokens=12, regex="(held|back)"))
    s.add_request(again)
    while s.has_work:
        s.step()
    assert again.finished_reason.type == "stop" and free.finished_reason is not None
    assert s.grammars.take_rejected() == []
    if sys.platform.startswith("linux"):
        assert niceness and set(niceness) == {COMPILE_NICENESS}
    assert scheduler_leaks(s) == []


def test_a_compile_reported_ready_is_used_even_after_the_cache_let_it_go(tokenizer):
    """The worker's follower keeps each compile it reported ready until a request follows it:
    with a cache that keeps only its newest grammar, the older one is let go, and is not
    compiled again (that compile would hold back the whole server)."""
    import spectral.constrained as constrained

    one = constrained.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    # The cache keeps only the newest; the one let go fits the bound beside it.
    size = max(one.compile("regex", t).memory_size_bytes for t in ("(a|b)+", "(c|d)+"))
    backend = constrained.GrammarBackend(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=size
    )
    compiles = []
    compile_once = backend._compile
    backend._compile = lambda kind, text: compiles.append(text) or compile_once(kind, text)
    follower = GrammarFollower(lambda: backend)
    for text in ("(a|b)+", "(c|d)+"):
        while not follower.ready("regex", text):
            time.sleep(0.01)
    follower.follow("r2", ("regex", "(c|d)+"), [], [])  # a matcher: the cache evicts
    assert backend.cache_info()["entries"] == 1  # "(a|b)+" let go
    matcher = follower.follow("r1", ("regex", "(a|b)+"), [], [])
    assert compiles == ["(a|b)+", "(c|d)+"]
    assert matcher.accept(tokenizer.convert_tokens_to_ids("a"))


def test_ready_compiles_no_request_came_for_stay_within_the_cache_bound(tokenizer):
    """A request may never be followed in the worker (it finished before a round, or its
    rounds were declined): the ready compiles kept for such requests, beyond what the cache
    itself holds, stay within the cache's byte bound (the newest always kept), where 64 of
    any size were kept before (a soak's worker grew ~3 MiB a minute)."""
    import spectral.constrained as constrained

    texts = [f"(a{i}|b{i})+" for i in range(16)]
    one = constrained.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    bound = 3 * one.compile("regex", texts[0]).memory_size_bytes
    backend = constrained.GrammarBackend(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=bound
    )
    follower = GrammarFollower(lambda: backend)
    for text in texts:
        while not follower.ready("regex", text):
            time.sleep(0.01)
    kept = follower._ready
    extra = sum(f.result().memory_size_bytes for k, f in kept.items() if not backend.holds(k))
    assert 0 < extra <= bound and ("regex", texts[-1]) in kept
    assert len(kept) < len(texts)


def test_the_follower_forgets_requests_that_left_the_round(tokenizer):
    """A matcher kept for a finished request would keep its compiled grammar alive past the
    cache's bound: a round's requests are the ones kept; one that comes back is followed
    again from its start (its output replayed), to the same state."""
    import spectral.constrained as constrained

    backend = constrained.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    follower = GrammarFollower(lambda: backend)
    a = tokenizer.convert_tokens_to_ids("a")
    first = follower.follow("r1", ("regex", "a+b"), [], [a])
    other = follower.follow("r2", ("regex", "a+b"), [], [])
    follower.retain({"r2"})
    assert follower.follow("r2", ("regex", "a+b"), [], []) is other
    again = follower.follow("r1", ("regex", "a+b"), [], [a, a])
    assert again is not first and not again.terminated
    assert again.accept(tokenizer.convert_tokens_to_ids("b"))


def test_memory_freed_by_a_compile_or_an_eviction_is_given_back(tokenizer, monkeypatch):
    """malloc_trim after each compile (its working memory) and each eviction; without it
    glibc keeps the freed pages as the process's high-water mark."""
    import spectral.constrained as constrained

    trims = []
    monkeypatch.setattr(constrained, "release_freed_memory", lambda: trims.append(1))
    backend = constrained.GrammarBackend(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=0
    )
    backend.compile("regex", "(a|b)+")
    assert len(trims) == 1
    backend.compile_later("regex", "(c|d)+").result(timeout=30)  # "(a|b)+" evicted
    assert len(trims) == 3


ARENA_PROBE = """
import sys, threading
from spectral.mem.process import arena_count, share_thread_arenas
if sys.argv[1] == "shared":
    share_thread_arenas()
def work():
    kept = [bytearray(4096) for _ in range(256)]
    allocated.wait()  # none ends (and frees its arena for the next) before all allocated
allocated = threading.Barrier(5)
threads = [threading.Thread(target=work) for _ in range(4)]
for thread in threads:
    thread.start()
allocated.wait()
for thread in threads:
    thread.join()
print(arena_count())
"""


@pytest.mark.parametrize("mode, arenas", [("own", 5), ("shared", 2)])
def test_threads_share_one_arena_in_the_scheduler(mode, arenas):
    """The scheduler calls share_thread_arenas first: compile threads started mid-run
    (the second only when two compiles first overlap) otherwise each grew an arena of their
    own, whose free memory stayed in the process's RSS (a soak's +5 MiB in one minute).
    Four threads at once: four arenas of their own, or all in one beside the main one."""
    import subprocess
    import sys

    from spectral.mem.process import arena_count

    if arena_count() == 0:  # not glibc's malloc: no arenas to count, and nothing is changed
        arenas = 0
    out = subprocess.run(
        [sys.executable, "-c", ARENA_PROBE, mode], capture_output=True, text=True, check=True
    )
    assert int(out.stdout) == arenas


def test_compiled_grammars_are_kept_within_their_bounds(tokenizer, monkeypatch):
    """The least recently asked-for compiled grammars go first beyond CACHE_ENTRIES or the
    bytes bound (xgrammar's own cache, unbounded, is off); a forgotten grammar compiles
    again."""
    import spectral.constrained as constrained

    monkeypatch.setattr(constrained, "CACHE_ENTRIES", 3)
    backend = constrained.GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    regexes = [f"(a|b){{{i}}}" for i in range(1, 6)]
    first = backend.compile_later("regex", regexes[0])
    first.result(timeout=30)
    for text in regexes[1:]:
        backend.compile_later("regex", text).result(timeout=30)
        backend.compile_later("regex", regexes[0])  # asked for again: the most recent
    info = backend.cache_info()
    assert info["entries"] == 3 and info["bytes"] > 0
    assert backend.compile_later("regex", regexes[0]) is first  # kept
    assert backend.compile_later("regex", regexes[1]).result(timeout=30) is not None  # anew
    bound = backend.cache_info()["bytes"] // 3
    backend.cache_bytes = bound  # --grammar-cache-mib
    assert backend.cache_info()["max_bytes"] == bound
    last = backend.compile_later("regex", "(e|f)+")  # eviction runs as a grammar is added
    added = last.result(timeout=30).memory_size_bytes  # counted once compiled
    assert 0 < backend.cache_info()["bytes"] - added <= bound
    assert backend.cache_info()["entries"] < 3
