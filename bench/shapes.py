"""Model directories of a given shape with no weights (served with --load-format dummy): a
config.json and a word-level tokenizer of exactly `vocab_size` tokens ("t3" is token 3), so a
machine without the real files (a lent GPU) can measure a shape, and tests can run models of
any size. Prompts are token ids."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# The default model's shape (SmolLM2-135M), Qwen2.5-Coder-1.5B's and Llama-3.1-8B's, and a tiny
# one for tests.
SHAPES = {
    "default": dict(
        architecture="LlamaForCausalLM",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "8b": dict(
        architecture="LlamaForCausalLM",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        architecture="LlamaForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1 (BOS), 2 (EOS)


def make_model_dir(path: Path, shape: str | dict, max_position_embeddings: int = 4096) -> str:
    """A directory with the config of `shape` (a name in SHAPES, or its fields) and a tokenizer
    of its vocabulary size."""
    fields = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    architecture = fields.pop("architecture")
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[architecture],
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        **fields,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), fields["vocab_size"])})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return str(path)
