"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over the paged KV cache.

Projections are fused at load time (q|k|v into `qkv_proj`, gate|up into `gate_up_proj`) so a
layer costs four matmuls. Normalisation runs in float32 and rotary embeddings in the model
dtype, in the same order of operations as transformers, so float32 outputs match it closely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spectral.forward import ForwardBatch
from spectral.kernels.base import AttentionBackend
from spectral.models.config import ModelConfig, rope_inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context length, looked up per token."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, scaling = rope_inverse_frequencies(config)
        positions = torch.arange(config.max_context_len, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin for the given positions."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(
            config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), *rope)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), *rope)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(backend.forward(q, k, v, self.layer_id, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, backend, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states [T, H] and the hidden states entering `batch.capture_layers`.

        Capture index i is the input of layer i (index `num_layers` is the last layer's output
        before the final norm), the same indexing as transformers' `output_hidden_states`.
        """
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary.lookup(batch.positions, x.dtype)
        captured: list[torch.Tensor] = []
        capture = batch.capture_layers
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured.append(x)
            x = layer(x, rope, backend, batch)
        if self.config.num_layers in capture:
            captured.append(x)
        return self.norm(x), captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [R, vocab] for the given rows of final hidden states."""
        return F.linear(hidden, self.lm_head_weight).float()
