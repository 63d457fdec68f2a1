"""The model facts the runtime needs, read once from a HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from spectral.layers.rotary import rope_settings
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
