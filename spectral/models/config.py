"""The model facts the runtime needs, read once from a HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from spectral.models.registry import architecture_of


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_context_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    hf_config: PretrainedConfig

    def context_length(self, override: int | None = None) -> int:
        """The context served: `override` (--context-length) where given, else the model's."""
        return override or self.max_context_len

    def features(self) -> dict[str, Any]:
        """What of its architecture the model uses (for /get_model_info)."""
        rope_type, theta = rope_settings(self.hf_config)
        return {
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_type": rope_type,
            "rope_theta": theta,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "sliding_window": getattr(self.hf_config, "sliding_window", None),
        }

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ModelConfig:
        """The config of a HF directory; UnsupportedModelError for an architecture spectral
        does not implement."""
        hf = AutoConfig.from_pretrained(model_dir)
        architecture = architecture_of(hf.to_dict())
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = hf.eos_token_id
        eos_ids = (
            tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        )
        max_ctx = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None)
        if window:
            max_ctx = min(max_ctx, window)
        return cls(
            architecture=architecture,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            max_context_len=max_ctx,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False))
            or architecture == "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_ids=eos_ids,
            hf_config=hf,
        )


def stop_token_ids(config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end generation: the model's EOS ids and the tokenizer's."""
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def rope_settings(hf: PretrainedConfig) -> tuple[str, float]:
    """(rope type, rope theta) of a HF config."""
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    return rope_type, float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def rope_inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling) per the config's rope settings."""
    hf = config.hf_config
    rope_type, theta = rope_settings(hf)
    if rope_type == "default":
        dim = config.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise NotImplementedError(
            "dynamic NTK rope scaling changes with the sequence length and is not supported; "
            "supported rope types: default, "
            + ", ".join(sorted(set(ROPE_INIT_FUNCTIONS) - {"dynamic"}))
        )
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"unknown rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scaling)
