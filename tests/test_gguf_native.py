"""The default model read straight from its GGUF: served from its blocks (--quantization gguf)
every weight matrix and embedding row expands to exactly transformers' dequantized weights
(gguf's own dequantization, then the model dtype), dequantized at load (none) every parameter
equals them, and greedy decoding from the blocks equals transformers' (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spectral.kernels.cpu_kernels import load_cpu_kernels
from spectral.layers.gguf_blocks import decode
from spectral.layers.linear import Linear
from spectral.models.config import ModelConfig
from spectral.models.gguf_native import load_gguf_model
from spectral.models.loader import build_model, load_model
from spectral.models.resolve import default_model_file, model_files_dir
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


def unpermute_llama_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion of q and k rows (its HF-to-GGUF script reshapes each
    head's rows as (2, d/2) and swaps the axes): here the inverse, (d/2, 2) swapped back."""
    out = rows.shape[0]
    return rows.reshape(heads, out // heads // 2, 2, -1).swapaxes(1, 2).reshape(out, -1)


def from_gguf(dtype: torch.dtype, native_kernels) -> tuple[torch.nn.Module, int]:
    config = ModelConfig.from_pretrained(model_files_dir("default"))
    model = build_model(config, dtype)
    served = load_gguf_model(default_model_file(), model, config, native_kernels)
    model.set_cpu_kernels(kernels)
    return model, served


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_weight_expands_to_transformers_dequantized_weights(default_model_dir, dtype):
    """The oracle: transformers' own GGUF conversion (gguf's dequantization), in `dtype`."""
    config = ModelConfig.from_pretrained(default_model_dir)
    reference = load_model(default_model_dir, config, dtype)
    model, served = from_gguf(dtype, kernels)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert served == len(linears) + 1  # and the LM head
    expected = dict(reference.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert module.packed.gguf_type == "Q4_1"
            assert module.weight.numel() == 0  # no dense copy beside the blocks
            weight = expected[f"{name}.weight"]
            assert torch.equal(expanded(module.packed, module.in_features, dtype), weight)
    for name, param in model.named_parameters():
        if param.numel():
            assert torch.equal(param, expected[name]), name
    head = model.lm_head_packed
    assert head.gguf_type == "Q8_0"
    rows = torch.eye(config.hidden_size, dtype=dtype)
    assert torch.equal(head.matmul(kernels, rows, None).T, reference.lm_head_weight)
    # The embedding is looked up from the Q8_0 blocks: every row, exactly.
    ids = torch.arange(config.vocab_size)
    assert model.embed_tokens.weight.numel() == 0  # no dense table beside the blocks
    assert torch.equal(model.embed(ids.view(2, -1)).view(len(ids), -1), reference.embed(ids))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_embedding_rows_dequantize_bit_equal_to_gguf(kind):
    """The torch lookup of block rows (a decode step's token embedding) against gguf's own
    dequantization of the same blocks; other formats are left to gguf."""
    import gguf
    import numpy as np

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    values = np.random.default_rng(4).standard_normal((9, 96)).astype(np.float32) * 5
    blocks = gguf.quants.quantize(values, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert torch.equal(decode(torch.from_numpy(blocks), kind).dequantize(), expected)
    with pytest.raises(ValueError, match="Q3_K is not decoded here"):
        decode(torch.from_numpy(blocks), "Q3_K")


def test_a_gguf_dequantized_at_load_equals_transformers_conversion(default_model_dir):
    """--quantization none reads the GGUF too, dequantizing every weight as transformers does."""
    reference = load_model(
        default_model_dir, ModelConfig.from_pretrained(default_model_dir), torch.float32
    )
    model, served = from_gguf(torch.float32, None)
    assert served == 0
    got = dict(model.named_parameters())
    assert got.keys() == dict(reference.named_parameters()).keys()
    for name, param in reference.named_parameters():
        assert torch.equal(got[name], param), name


@pytest.fixture(scope="module")
def native_engine(tmp_path_factory):
    from spectral import Engine

    cache = tmp_path_factory.mktemp("model-cache")
    engine = Engine(
        model_path="default",
        dtype="float32",
        quantization="gguf",  # the exact path (auto would take the integer one on a CPU)
        max_total_tokens=4096,
        model_cache_dir=str(cache),
    )
    engine.cache_dir = cache
    yield engine
    engine.shutdown()


def test_the_engine_serves_the_default_models_blocks_without_converting_it(native_engine):
    model = native_engine.worker.model
    assert model.layers[0].mlp.down_proj.packed.gguf_type == "Q4_1"
    assert model.lm_head_packed.gguf_type == "Q8_0"
    # Only the config and tokenizer were extracted into the cache: no dequantized weights.
    (extracted,) = native_engine.cache_dir.iterdir()
    assert (extracted / "config.json").is_file() and (extracted / "tokenizer.json").is_file()
    assert not list(extracted.glob("*.safetensors"))


def test_greedy_from_the_blocks_equals_transformers_on_20_prompts(
    native_engine, hf_model, tokenizer
):
    prompts = PROMPTS + MORE_PROMPTS
    new_tokens = 8
    expected = [hf_greedy(hf_model, tokenizer(p)["input_ids"], new_tokens) for p in prompts]
    outs = native_engine.generate(prompts, {**GREEDY, "max_new_tokens": new_tokens})
    assert [o["output_ids"] for o in outs] == expected


def test_packing_in_slices_equals_packing_at_once(monkeypatch):
    """Rows of several tensors packed a slice at a time (slices straddling tensors, a short
    last one) into one tensor: the same bytes as one packing of all rows, for the exact and the
    integer path; slices in different layouts give None."""
    from spectral.layers.gguf_blocks import pack_blocks, pack_int8
    from spectral.models import gguf_native
    from tests.test_gguf_blocks import random_blocks

    kernels = load_cpu_kernels()
    monkeypatch.setattr(gguf_native, "SLICE_ROWS", 32)
    arrays = [random_blocks("Q4_1", rows, 2, seed) for rows, seed in ((50, 1), (7, 2), (40, 3))]
    whole = torch.from_numpy(np.concatenate(arrays))
    for pack in (
        lambda rows: (pack_blocks(rows, "Q4_1", 64, kernels), "Q4_1"),
        lambda rows: pack_int8(rows, "Q4_1", 64, kernels),
    ):
        data, name = gguf_native.pack_in_slices(arrays, pack)
        expected, expected_name = pack(whole)
        assert name == expected_name and torch.equal(data, expected)
    names = iter(["A", "A", "B", "A"])
    assert gguf_native.pack_in_slices(arrays, lambda rows: (rows.flatten(), next(names))) is None


def test_the_weights_reader_keeps_every_tensor_and_no_vocabulary():
    """Loading reads the file through a reader that skips the vocabulary's metadata (hundreds of
    MB of NumPy arrays for a large vocabulary): the same tensors at the same offsets as gguf's
    own reader, the other metadata kept."""
    import gguf

    from spectral.models.gguf_reader import WeightsReader

    full, light = gguf.GGUFReader(default_model_file()), WeightsReader(default_model_file())
    assert [(t.name, t.data_offset, t.n_bytes) for t in light.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in full.tensors
    ]
    assert any(k.startswith("tokenizer.") for k in full.fields)
    assert set(light.fields) == {k for k in full.fields if not k.startswith("tokenizer.")}
    assert light.fields["general.architecture"].contents() == "llama"


@pytest.mark.parametrize("fmt", ["Q5_0", "Q8_0", "Q4_K_M", "Q4_0"])
def test_requantized_layers_expand_to_ggufs_own_q4_1_of_the_stored_weights(tmp_path, fmt):
    """`requantize="Q4_1"` (a draft model's --speculative-draft-quantization q4_1): every layer
    matrix stored in more bits a weight expands to gguf's own Q4_1 quantization of gguf's own
    dequantization of the stored blocks (rows as the model uses them, llama's q and k
    unpermuted by llama.cpp's rule, written out here); tensors
    stored in 4-bit formats (Q4_0, Q4_K) and the LM head stay as stored."""
    import gguf

    from spectral.models.gguf_native import LAYER_LINEARS, bits_per_weight
    from tests.gguf_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", fmt)
    config = ModelConfig.from_pretrained(model_files_dir(str(path), str(tmp_path / "cache")))
    models = []
    for requantize in (None, "Q4_1"):
        model = build_model(config, torch.float32)
        load_gguf_model(path, model, config, kernels, requantize=requantize)
        model.set_cpu_kernels(kernels)
        models.append(model)
    stored, requantized = models
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    kv = config.num_kv_heads * config.head_dim
    out_rows = {"attn_q": config.num_heads * config.head_dim, "attn_k": kv, "attn_v": kv}
    out_rows |= {"attn_output": config.hidden_size, "ffn_down": config.hidden_size}
    out_rows |= {"ffn_gate": config.intermediate_size, "ffn_up": config.intermediate_size}
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    changed = 0
    for i, again in enumerate(requantized.layers):
        for ours, theirs in LAYER_LINEARS.items():
            parts = []
            for name in theirs:
                stored_tensor = tensors[f"blk.{i}.{name}.weight"]
                kind = types[stored_tensor.name]
                # gguf's own dequantization of the stored blocks, in the model's row order
                part = gguf.quants.dequantize(stored_tensor.data, stored_tensor.tensor_type)
                assert part.shape[0] == out_rows[name]
                if name in heads:
                    part = unpermute_llama_rows(part, heads[name])
                if bits_per_weight(kind) > bits_per_weight("Q4_1"):
                    part = gguf.quants.dequantize(gguf.quants.quantize(part, q4_1), q4_1)
                    changed += 1
                parts.append(torch.from_numpy(np.ascontiguousarray(part)))
            module = again.get_submodule(ours)
            got = expanded(module.packed, module.in_features, torch.float32)
            assert torch.equal(got, torch.cat(parts)), (i, ours)
    assert changed == {"Q4_0": 0, "Q4_K_M": 2 * 3}.get(fmt, 2 * 7)  # Q6_K: v, o and down
    k = config.hidden_size
    assert torch.equal(
        expanded(requantized.lm_head_packed, k, torch.float32),
        expanded(stored.lm_head_packed, k, torch.float32),
    )
