"""Every architecture spectral accepts gives transformers' greedy tokens (float32), from GGUF
files as llama.cpp writes them (served from their blocks, and dequantized at load) and from HF
directories; the architecture comes from the config's `architectures`, else its `model_type`,
and anything else is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spectral import Engine
from spectral.layers.gguf_blocks import LAYOUTS
from spectral.layers.linear import Linear, PackedRows
from spectral.models.config import ModelConfig
from spectral.models.registry import UnsupportedModelError, architecture_in_header, check_gguf
from spectral.models.resolve import model_files_dir
from tests.conftest import assert_no_leaks, make_tiny_model
from tests.gguf_models import ARCHS, FORMATS, write_foreign_gguf, write_tiny_gguf
from tests.test_generate_greedy import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
EXPECTED_HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
EXPECTED_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "LlamaForCausalLM",  # llama.cpp writes Mistral models as llama
    "qwen2": "Qwen2ForCausalLM",
}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-ggufs")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("model-cache"))


def tiny_gguf(gguf_dir: Path, arch: str, fmt: str) -> Path:
    path = gguf_dir / f"{arch}-{fmt}.gguf"
    return path if path.is_file() else write_tiny_gguf(path, arch, fmt)


def transformers_greedy(model_dir: str, gguf_file: str | None = None) -> list[list[int]]:
    """transformers' own greedy tokens for PROMPTS (loading the GGUF itself where given)."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    return [hf_greedy(model, tokenizer(p)["input_ids"], NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_greedy_equals_transformers_loading_the_same_file(gguf_dir, cache_dir, arch, fmt):
    path = tiny_gguf(gguf_dir, arch, fmt)
    expected = transformers_greedy(str(gguf_dir), path.name)
    # A float GGUF is dense either way: "none" differs only where there are blocks.
    for quantization in ("gguf", "none") if fmt != "F32" else ("gguf",):
        engine = Engine(
            model_path=str(path),
            dtype="float32",
            quantization=quantization,
            max_total_tokens=1024,
            model_cache_dir=cache_dir,
        )
        try:
            assert engine.model.architecture == EXPECTED_CLASS[arch]
            packed = {
                m.packed.gguf_type
                for m in engine.worker.model.modules()
                if isinstance(m, Linear)
                if m.packed is not None
            }
            # Served from the file's own blocks, or dequantized at load (then packed as dense).
            native = quantization == "gguf" and fmt != "F32"
            assert packed == ({LAYOUTS[fmt]} if native else {None})
            outs = engine.generate(PROMPTS, GREEDY)
            assert [o["output_ids"] for o in outs] == expected, (arch, fmt, quantization)
            assert_no_leaks(engine)
        finally:
            engine.shutdown()


def test_a_qwen2_gguf_keeps_its_qkv_biases_and_untied_head(gguf_dir, cache_dir):
    config = ModelConfig.from_pretrained(
        model_files_dir(str(tiny_gguf(gguf_dir, "qwen2", "Q8_0")), cache_dir)
    )
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.features() == {
        "attention_bias": True,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "rope_type": "default",
        "rope_theta": 1e6,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "sliding_window": None,
    }


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_hf_directory_greedy_equals_transformers(tmp_path, default_model_dir, model_type):
    """A HF directory per architecture class, as transformers writes it (Mistral's config with
    its sliding window, Qwen2's with its biases)."""
    model_dir = make_tiny_model(
        tmp_path,
        default_model_dir,
        seed=3,
        model_type=model_type,
        rope_theta=1e6,
        initializer_range=0.3,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
    )
    expected = transformers_greedy(model_dir)
    engine = Engine(model_path=model_dir, dtype="float32", max_total_tokens=1024)
    try:
        assert engine.model.architecture == EXPECTED_HF_CLASS[model_type]
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in outs] == expected
    finally:
        engine.shutdown()


def write_config(directory: Path, **fields) -> str:
    directory.mkdir(exist_ok=True)
    base = AutoConfig.for_model("llama", vocab_size=512, hidden_size=64, num_attention_heads=4)
    data = {k: v for k, v in base.to_dict().items() if k not in ("architectures", "model_type")}
    (directory / "config.json").write_text(json.dumps({**data, **fields}))
    return str(directory)


def test_the_architecture_comes_from_model_type_when_architectures_is_missing(tmp_path):
    config = ModelConfig.from_pretrained(write_config(tmp_path, model_type="qwen2"))
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.attention_bias


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    directory = write_config(tmp_path, model_type="gemma", architectures=["GemmaForCausalLM"])
    with pytest.raises(
        UnsupportedModelError,
        match="GemmaForCausalLM.*supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
    ):
        ModelConfig.from_pretrained(directory)


def test_a_model_type_without_an_implementation_is_refused_by_name(tmp_path):
    directory = write_config(tmp_path / "phi3", model_type="phi3")
    with pytest.raises(UnsupportedModelError, match="model_type 'phi3'"):
        ModelConfig.from_pretrained(directory)


def test_a_gguf_of_an_unsupported_architecture_is_refused_at_start(gguf_dir, cache_dir):
    path = write_foreign_gguf(gguf_dir / "phi3.gguf", "phi3")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'phi3'.*llama, qwen2"):
        Engine(model_path=str(path), dtype="float32", model_cache_dir=cache_dir)


@pytest.mark.parametrize("architecture_last", [False, True], ids=["first", "last"])
def test_a_ggufs_architecture_is_read_wherever_its_header_puts_it(gguf_dir, architecture_last):
    """First (llama.cpp's writers): from the header alone; anywhere else: by gguf's reader."""
    where = "last" if architecture_last else "first"
    qwen2 = write_tiny_gguf(gguf_dir / f"qwen2-{where}.gguf", "qwen2", "F32", 0, architecture_last)
    phi3 = write_foreign_gguf(gguf_dir / f"phi3-{where}.gguf", "phi3", architecture_last)
    assert (architecture_in_header(qwen2) is None) == architecture_last
    assert check_gguf(qwen2) == "qwen2"
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'phi3'"):
        check_gguf(phi3)


def test_load_format_dummy_serves_the_configs_shape_with_random_weights(tmp_path):
    from bench.shapes import make_model_dir

    model_dir = make_model_dir(tmp_path / "tiny", "tiny")  # config and tokenizer, no weights
    engine = Engine(
        model_path=model_dir, dtype="float32", load_format="dummy", max_total_tokens=512
    )
    try:
        model = engine.worker.model
        assert model.config.hidden_size == 128 and len(model.layers) == 2
        weight = model.layers[1].mlp.down_proj.weight
        assert weight.shape == (128, 256) and 0.015 < float(weight.std()) < 0.025
        assert torch.equal(model.norm.weight, torch.ones(128))
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
        assert len(out["output_ids"]) == NEW_TOKENS
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="--load-format dummy takes a HF model directory"):
        Engine(model_path="default", load_format="dummy")


def test_a_q4_k_m_mix_is_served_natively_in_parts_and_equals_transformers(gguf_dir, cache_dir):
    """llama.cpp's Q4_K_M: q and k Q4_K but v Q6_K in one fused q|k|v, served as packed parts of
    two layouts stacked by rows (decode steps in the one-call C++ layer); greedy output equals
    transformers loading the same file."""
    path = tiny_gguf(gguf_dir, "qwen2", "Q4_K_M")
    expected = transformers_greedy(str(gguf_dir), path.name)
    engine = Engine(
        model_path=str(path),
        dtype="float32",
        quantization="gguf",
        max_total_tokens=1024,
        model_cache_dir=cache_dir,
    )
    try:
        qkv = engine.worker.model.layers[0].self_attn.qkv_proj.packed
        assert isinstance(qkv, PackedRows)
        assert [part.gguf_type for part in qkv.parts] == ["Q4_1", "Q8_0h"]
        assert engine.worker.model.layers[0].fused is not None  # parts run in the C++ layer too
        assert engine.worker.model.layers[0].self_attn.qkv_proj.weight.numel() == 0
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in outs] == expected
        assert_no_leaks(engine)
    finally:
        engine.shutdown()
