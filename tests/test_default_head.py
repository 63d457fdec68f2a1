"""The EAGLE-3 head shipped for the embedded default model: `--speculative-algorithm EAGLE3`
alone loads it, its output is the plain output token for token (float32), and it is a trained
head (a random head's drafts are almost never accepted)."""

from __future__ import annotations

import pytest

from spectral import Engine
from spectral.speculative.drafters.eagle_head import DEFAULT_HEAD_DIR
from tests.conftest import assert_no_leaks

PROMPTS = [
    "Write a short poem about the sea.",
    "What are three tips for staying productive while working from home?",
    "Explain what a binary search does.",
    "Describe the water cycle in simple terms.",
]


@pytest.fixture(scope="module")
def chat_prompts(tokenizer) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]


def test_the_default_head_is_lossless_and_accepts_drafts(engine_fp32, chat_prompts) -> None:
    assert (DEFAULT_HEAD_DIR / "model.safetensors").exists()
    params = {"temperature": 0.0, "max_new_tokens": 32}
    plain = engine_fp32.generate(chat_prompts, params)
    with Engine(
        model_path="default",
        dtype="float32",
        quantization="gguf",  # the exact path: the plain engine's weights, bit for bit
        max_total_tokens=8192,
        speculative_algorithm="EAGLE3",
        # Every request verifies the default tree every round (the planner would size trees
        # by this machine's costs, which may leave a round or none to count).
        speculative_fixed_tree=True,
        speculative_max_batch_size=4,
    ) as engine:
        assert engine.args.spec.draft_model_path == "default"
        outs = engine.generate(chat_prompts, params)
        assert [o["output_ids"] for o in outs] == [p["output_ids"] for p in plain]
        rounds = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
        emitted = sum(len(o["output_ids"]) for o in outs)
        # A trained head: 1.5 tokens per round here (fp32, these prompts); a random head's
        # drafts are almost never accepted, which gives about 1.03.
        assert emitted / rounds > 1.3, emitted / rounds
        assert_no_leaks(engine)
