"""The default model served from its GGUF blocks (--quantization auto): every weight matrix
expands to exactly the dequantized weights (gguf's own dequantization, then the model dtype),
and greedy decoding equals transformers' on the dequantized model (float32)."""

from __future__ import annotations

import pytest
import torch

from spectral.kernels.cpu_kernels import load_cpu_kernels
from spectral.kernels.linear import Linear
from spectral.models.gguf_native import attach_gguf_blocks
from spectral.models.loader import load_model
from spectral.models.resolve import default_model_file
from tests.test_generate_greedy import GREEDY, PROMPTS, hf_greedy

kernels = load_cpu_kernels()  # needs a C++ compiler, as the project does

MORE_PROMPTS = [
    "The three laws of motion are",
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\ndef mean(xs):",
    "Water boils at",
    "The largest planet in the solar system",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Dear hiring manager,",
    "SELECT name FROM users WHERE",
    "In 1969, the first humans",
    "A recipe for pancakes: first,",
    "The opposite of hot is",
    "<|im_start|>user\nTranslate 'good morning' into French.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis converts",
    "for i in range(10):",
    "My favourite book is",
]


def expanded(packed, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weights as the kernel expands them: the identity times them is exactly them."""
    return packed.matmul(kernels, torch.eye(k, dtype=dtype), None).T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_weight_matrix_expands_to_the_dequantized_weights(default_model_dir, dtype):
    model, config = load_model(default_model_dir, dtype)
    attached = attach_gguf_blocks(model, config, default_model_file(), kernels)
    model.set_cpu_kernels(kernels)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert attached == len(linears) + 1  # and the LM head
    for module in linears:
        assert module.packed.gguf_type == "Q4_1"
        assert torch.equal(expanded(module.packed, module.in_features, dtype), module.weight)
    head = model.lm_head_packed
    assert head.gguf_type == "Q8_0"
    rows = torch.eye(config.hidden_size, dtype=dtype)
    assert torch.equal(head.matmul(kernels, rows, None).T, model.lm_head_weight)


@pytest.fixture(scope="module")
def native_engine():
    from spectral import Engine

    engine = Engine(model_path="default", dtype="float32", max_total_tokens=4096)
    yield engine
    engine.shutdown()


def test_the_engine_serves_the_default_models_blocks(native_engine):
    model = native_engine.worker.model
    assert model.layers[0].mlp.down_proj.packed.gguf_type == "Q4_1"
    assert model.lm_head_packed.gguf_type == "Q8_0"


def test_greedy_from_the_blocks_equals_transformers_on_20_prompts(
    native_engine, hf_model, tokenizer
):
    prompts = PROMPTS + MORE_PROMPTS
    new_tokens = 12
    expected = [hf_greedy(hf_model, tokenizer(p)["input_ids"], new_tokens) for p in prompts]
    outs = native_engine.generate(prompts, {**GREEDY, "max_new_tokens": new_tokens})
    assert [o["output_ids"] for o in outs] == expected
