"""Greedy generation equals transformers' greedy generation token for token (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_no_leaks

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13,",
]
NEW_TOKENS = 32


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with transformers' KV cache, not stopping at EOS."""
    out: list[int] = []
    past = None
    step_input = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(step_input, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            step_input = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module")
def expected(hf_model, tokenizer) -> list[list[int]]:
    return [hf_greedy(hf_model, tokenizer(p)["input_ids"], NEW_TOKENS) for p in PROMPTS]


GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def test_greedy_one_at_a_time(engine_fp32, expected):
    for prompt, want in zip(PROMPTS, expected):
        out = engine_fp32.generate(prompt, GREEDY)
        assert out["output_ids"] == want
    assert_no_leaks(engine_fp32)


def test_greedy_as_one_batch_of_mixed_lengths(engine_fp32, expected):
    outs = engine_fp32.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["completion_tokens"] == NEW_TOKENS for o in outs)
    assert_no_leaks(engine_fp32)


def test_greedy_without_cpu_kernels_matches_too(default_model_dir, expected):
    from spectral import Engine

    engine = Engine(
        model_path=default_model_dir,
        dtype="float32",
        max_total_tokens=2048,
        disable_cpu_kernels=True,
    )
    assert engine.worker.model.kernels is None
    out = engine.generate(PROMPTS[0], GREEDY)
    assert out["output_ids"] == expected[0]
    assert_no_leaks(engine)


def test_greedy_with_chunked_prefill_and_no_radix_cache_matches(default_model_dir, expected):
    from spectral import Engine

    # These options change only how the prompt is prefilled: 16 new tokens show it.
    short = {**GREEDY, "max_new_tokens": 16}
    # Chunks of 4 split every one of these prompts (5, 13 and 6 tokens).
    for options in ({"chunked_prefill_size": 4}, {"disable_radix_cache": True}):
        engine = Engine(
            model_path=default_model_dir, dtype="float32", max_total_tokens=4096, **options
        )
        outs = engine.generate(PROMPTS[:3], short)
        assert [o["output_ids"] for o in outs] == [want[:16] for want in expected[:3]]
        assert_no_leaks(engine)
        engine.shutdown()
