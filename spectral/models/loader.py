"""Build a model from a HF directory: read safetensors by name, fuse projections, check shapes.
(A GGUF file is read by spectral.models.gguf_native.)"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from spectral.layers.rotary import RotaryEmbedding
from spectral.models.config import ModelConfig
from spectral.models.llama import LlamaForCausalLM
from spectral.models.registry import ARCHITECTURES

# The model class of each architecture: one decoder serves the Llama family (Qwen2's q/k/v
# biases come from the config, Mistral's sliding window caps the context served).
MODEL_CLASSES: dict[str, type[nn.Module]] = dict.fromkeys(ARCHITECTURES.values(), LlamaForCausalLM)

# HF tensor name → (our parameter name, row offset key within a fused matrix or None)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _fused_offsets(config: ModelConfig, fused: str) -> list[int]:
    if fused.endswith("qkv_proj"):
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        return [0, q, q + kv, q + 2 * kv]
    return [0, config.intermediate_size, 2 * config.intermediate_size]


def _target(config: ModelConfig, name: str) -> tuple[str, slice | None]:
    """Our parameter name and the row slice `name` fills in it (None: the whole tensor)."""
    if name.startswith("model.") and not _LAYER.match(name):
        return name[len("model.") :], None
    if name.startswith("lm_head."):
        return name, None
    m = _LAYER.match(name)
    if not m:
        return name, None
    layer, rest = m.groups()
    for hf_prefix, (ours, part) in _FUSED.items():
        if rest.startswith(hf_prefix + "."):
            suffix = rest[len(hf_prefix) :]
            offsets = _fused_offsets(config, ours)
            return f"layers.{layer}.{ours}{suffix}", slice(offsets[part], offsets[part + 1])
    return f"layers.{layer}.{rest}", None


def build_model(config: ModelConfig, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """The model for `config` with uninitialised weights of `dtype` on `device`."""
    cls = MODEL_CLASSES[config.architecture]  # ModelConfig refuses any other
    with torch.device("meta"):
        model = cls(config)
    # In `dtype` while still on meta (free), then memory left untouched until a weight is written:
    # a weight that GGUF blocks replace never becomes resident.
    model = model.to(dtype).to_empty(device=device)
    model.rotary = RotaryEmbedding(config.hf_config, config.head_dim, config.max_context_len).to(
        device
    )
    return model


def load_model(
    model_dir: str, config: ModelConfig, dtype: torch.dtype, device: str = "cpu"
) -> nn.Module:
    """The model of a HF directory's safetensors (`config` read from it), in `dtype` on
    `device`."""
    model = build_model(config, dtype, device)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                ours, rows = _target(config, name)
                if ours == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if ours not in params:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r}")
                tensor = f.get_tensor(name)
                dest = params[ours].data if rows is None else params[ours].data[rows]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(dest.shape)}"
                    )
                dest.copy_(tensor.to(dtype))
                filled[ours] += tensor.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ValueError(f"{model_dir}: weights missing for {', '.join(missing[:5])}")
    model.requires_grad_(False)
    model.eval()
    return model


def dummy_model(
    config: ModelConfig, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> nn.Module:
    """The model of `config` with random weights made on `device` (--load-format dummy):
    matrices and biases normal with std 0.02, norms ones, as transformers initialises a
    Llama."""
    model = build_model(config, dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
    model.requires_grad_(False)
    model.eval()
    return model
