"""The default model served through the integer path (`--quantization gguf-int8`, what auto
takes for a GGUF on a CPU): speculative
decoding (EAGLE3 with the shipped head, NGRAM) gives plain decoding's tokens on 20 prompts, one
to eight requests at a time, and a grammar holds under speculation. Lossless because every row
of a forward is computed alike whatever rows share it (tests/test_gguf_int8.py)."""

from __future__ import annotations

import re

import pytest

from spectral import Engine
from spectral.layers.linear import Linear
from tests.conftest import assert_no_leaks

TOPICS = [
    "the sea",
    "binary search",
    "the water cycle",
    "copper",
    "a lighthouse",
    "prime numbers",
    "bread",
    "the moon",
    "a compiler",
    "rain",
    "chess",
    "volcanoes",
    "a bicycle",
    "tea",
    "gravity",
    "a library",
    "winter",
    "the internet",
    "bees",
    "a river",
]
PARAMS = {"temperature": 0.0, "max_new_tokens": 16}


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[str]:
    # Half of them repeat a phrase, which NGRAM drafts from.
    return [
        chat(tokenizer, f"Write two sentences about {t}." if i % 2 else f"Say '{t}, {t}, {t}'.")
        for i, t in enumerate(TOPICS)
    ]


def engine(**options) -> Engine:
    return Engine(
        model_path="default",  # a GGUF on a CPU: --quantization auto is gguf-int8
        dtype="float32",
        max_total_tokens=8192,
        max_running_requests=8,
        **options,
    )


def test_auto_takes_the_integer_path_for_a_gguf_on_a_cpu_with_its_kernels():
    from spectral.args import ServerArgs

    auto = ServerArgs(device="cpu")
    assert auto.quantization == "auto"
    assert auto.resolved_quantization(gguf=True) == "gguf-int8"
    assert auto.resolved_quantization(gguf=False) == "none"
    assert ServerArgs(device="cpu", disable_cpu_kernels=True).resolved_quantization(True) == "gguf"
    assert ServerArgs(device="cuda").resolved_quantization(True) == "gguf"
    for chosen in ("gguf", "gguf-int8", "none"):
        assert ServerArgs(device="cpu", quantization=chosen).resolved_quantization(True) == chosen


def test_auto_dtype_is_float32_for_the_integer_path_on_a_cpu(monkeypatch):
    """Its activations are quantized to 8 bits for the matmuls anyway; elsewhere auto is
    bfloat16 where the CPU has it natively."""
    import torch

    import spectral.args as args_module
    from spectral.args import ServerArgs

    monkeypatch.setattr(args_module, "cpu_has_native_bf16", lambda: True)
    auto = ServerArgs(device="cpu")
    assert auto.resolved_dtype(gguf=True) == torch.float32
    assert auto.resolved_dtype(gguf=False) == torch.bfloat16
    assert ServerArgs(device="cpu", quantization="gguf").resolved_dtype(True) == torch.bfloat16
    assert ServerArgs(device="cpu", disable_cpu_kernels=True).resolved_dtype(True) == torch.bfloat16
    assert ServerArgs(device="cpu", dtype="bfloat16").resolved_dtype(True) == torch.bfloat16
    monkeypatch.setattr(args_module, "cpu_has_native_bf16", lambda: False)
    assert ServerArgs(device="cpu").resolved_dtype(gguf=False) == torch.float32


SPECULATIVE = {
    "EAGLE3": dict(speculative_algorithm="EAGLE3"),
    "NGRAM": dict(speculative_algorithm="NGRAM"),
}


@pytest.fixture(scope="module")
def plain_engine():
    with engine() as e:
        assert e.worker.model.lm_head_packed.gguf_type.endswith("+q8")
        info = e.get_server_info()
        assert info["quantization"] == "gguf-int8" and info["dtype"] == "float32"
        yield e


@pytest.fixture(scope="module")
def plain(prompts, plain_engine) -> list[list[int]]:
    return [o["output_ids"] for o in plain_engine.generate(prompts, PARAMS)]


@pytest.fixture(scope="module", params=list(SPECULATIVE))
def speculative(request):
    # Every request verifies a tree every round, whatever this machine's costs.
    options = dict(speculative_fixed_tree=True, speculative_max_batch_size=8)
    with engine(**SPECULATIVE[request.param], **options) as e:
        drafter = e.worker.drafter
        if drafter is not None:  # the head's matmuls take the target's (integer) path too
            layouts = [m.packed.gguf_type for m in drafter.head.modules() if isinstance(m, Linear)]
            assert layouts and all(layout.endswith("+q8") for layout in layouts), layouts
        yield e


def test_speculation_on_the_integer_path_gives_plain_decodings_tokens(speculative, prompts, plain):
    outs = speculative.generate(prompts, PARAMS)
    assert [o["output_ids"] for o in outs] == plain
    rounds = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    accepted = sum(len(o["output_ids"]) for o in outs) / rounds
    assert rounds > 0 and accepted > 1.1, (rounds, accepted)
    # One at a time too: a row's result does not depend on its batch.
    assert speculative.generate(prompts[3], PARAMS)["output_ids"] == plain[3]
    assert_no_leaks(speculative)


def test_a_grammar_holds_under_speculation_on_the_integer_path(
    speculative, plain_engine, tokenizer
):
    pattern = r"(yes|no), because [a-z ]{5,30}\."
    params = {**PARAMS, "max_new_tokens": 40, "regex": pattern}
    question = chat(tokenizer, "Is the sea salty? Answer yes or no, then why.")
    expected = plain_engine.generate(question, params)
    got = speculative.generate(question, params)
    assert got["output_ids"] == expected["output_ids"]
    assert re.fullmatch(pattern, got["text"]), got["text"]
    assert_no_leaks(speculative)
