"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over the paged KV cache.

Projections are fused at load time (q|k|v into `qkv_proj`, gate|up into `gate_up_proj`).
Normalisation runs in float32 and rotary in the model dtype, in transformers' order of
operations, so float32 outputs match it. Where the worker provides spectral's CPU kernels, the
layers run through them, and on CUDA through fused kernels (layers.cuda_fused); the PyTorch
code is their reference and the path everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from spectral.attention.base import AttentionBackend, DecodeKernelInputs
from spectral.core.forward import ForwardBatch
from spectral.layers import cuda_fused
from spectral.layers.linear import Linear, PackedRows, PackedWeight
from spectral.layers.logits import LogitsHead
from spectral.layers.norm import RMSNorm
from spectral.layers.parallel import TensorParallel
from spectral.layers.rotary import RotaryEmbedding
from spectral.layers.routing import route_to_cpu_kernels
from spectral.models.config import ModelConfig

if TYPE_CHECKING:
    from spectral.models.tensor_parallel import LlamaShares


@dataclass
class LayerContext:
    """What every layer of one forward shares. `decode` is set where attention runs through
    the CPU kernels' decode_attention: then each layer may run as one fused kernel call."""

    batch: ForwardBatch
    backend: AttentionBackend
    rotary: RotaryEmbedding
    kernels: ModuleType | None
    decode: DecodeKernelInputs | None = None

    def fused_args(self, k, v) -> tuple:
        """The arguments after x (and residual) of a fused layer's or stack's forward, with
        its KV buffers k and v (a layer's, or every layer's as lists)."""
        decode, batch = self.decode, self.batch
        return (
            batch.positions,
            self.rotary.cos,
            self.rotary.sin,
            k,
            v,
            batch.out_cache_loc,
            decode.kv_indices,
            decode.seq_lens,
            decode.scaling,
            decode.extend_lens,
        )


class LlamaAttention(nn.Module):
    tp: TensorParallel | None = None  # this rank's heads only: o's outputs summed over ranks

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        kv = ctx.backend.kv_store(self.layer_id, ctx.batch) if qkv.is_cuda else None
        if kv is not None:  # rotation and the KV writes in one kernel, where one serves
            heads = (self.num_heads, self.num_kv_heads, self.head_dim)
            rotated = ctx.rotary.rotate_and_store(qkv, heads, ctx.batch.positions, kv)
            if rotated is not None:
                out = self.o_proj(ctx.backend.attend(rotated, self.layer_id, ctx.batch))
                return out if self.tp is None else self.tp.sum(out)
        q, k = ctx.rotary.rotate_qkv(q, k, qkv, ctx.batch.positions, ctx.kernels)
        out = self.o_proj(ctx.backend.forward(q, k, v, self.layer_id, ctx.batch))
        return out if self.tp is None else self.tp.sum(out)


class LlamaMLP(nn.Module):
    tp: TensorParallel | None = None  # this rank's share of the rows: down's outputs summed

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = cuda_fused.silu_and_mul(gate_up) if gate_up.is_cuda else None
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        out = self.down_proj(act)
        return out if self.tp is None else self.tp.sum(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    fused = None  # the layer as one CPU-kernel call (kernels.DecoderLayer), where it can be

    def fuse(self, kernels: ModuleType | None) -> None:
        """Build the one-call form of this layer over its packed weights (after they are
        packed), where every matmul has them and the kernels provide it."""
        linears = (
            self.self_attn.qkv_proj,
            self.self_attn.o_proj,
            self.mlp.gate_up_proj,
            self.mlp.down_proj,
        )
        self.fused = None
        if kernels is None or any(m.packed is None for m in linears):
            return
        packed = [kernels.PackedLinear(*PackedRows.of(m.packed).fields(), m.bias) for m in linears]
        attn = self.self_attn
        self.fused = kernels.DecoderLayer(
            self.input_layernorm.weight,
            self.post_attention_layernorm.weight,
            self.input_layernorm.eps,
            *packed,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            self.mlp.intermediate_size,
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: LayerContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual block in fused form: takes and returns (delta, residual), whose sum
        is the hidden state (with residual None, x alone is)."""
        decode = ctx.decode
        if decode is not None and self.fused is not None:
            layer = self.self_attn.layer_id
            pool = decode.kv_pool
            delta, residual = self.fused.forward(
                x, residual, *ctx.fused_args(pool.k[layer], pool.v[layer])
            )
            return delta, residual
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    # A tensor-parallel rank (models.tensor_parallel): its group, and its shares of the model
    tp: TensorParallel | None = None
    shares: LlamaShares | None = None
    # under tensor parallelism, the first vocabulary row this rank's embedding holds (None:
    # it holds them all)
    vocab_start: int | None = 0

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.kernels: ModuleType | None = None
        self.fused_stack = None  # kernels.DecoderStack of the fused layers (set_cpu_kernels)
        # given its (empty) weight: an initialisation would cost seconds even on meta (the
        # first random fill there imports torch's decompositions)
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim, config.max_context_len)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_head = LogitsHead(self._lm_head_weight)

    def _lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return self.lm_head.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The dense LM head (empty where only GGUF blocks of it are kept)."""
        return self.logits_head.weight

    @property
    def lm_head_packed(self) -> PackedWeight | None:
        """The LM head as the CPU kernels stream it (GGUF blocks are attached here at load)."""
        return self.logits_head.packed

    @lm_head_packed.setter
    def lm_head_packed(self, packed: PackedWeight | None) -> None:
        self.logits_head.packed = packed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `input_ids` (from GGUF blocks where the model keeps those)."""
        if self.tp is not None and self.vocab_start is not None:  # this rank's rows
            return self.tp.embed(input_ids, self.embed_tokens.weight, self.vocab_start)
        return self.embed_tokens(input_ids)

    def set_cpu_kernels(self, kernels: ModuleType | None) -> None:
        """Route norms, rotary and matmuls through spectral's CPU kernels (None: PyTorch)."""
        self.kernels = kernels
        route_to_cpu_kernels(self, kernels)
        for layer in self.layers:
            layer.fuse(kernels if self.tp is None else None)  # ranks sum inside a layer
        fused = [layer.fused for layer in self.layers]
        self.fused_stack = None  # every layer in one kernel call, where every layer has one
        if kernels is not None and fused and all(f is not None for f in fused):
            self.fused_stack = kernels.DecoderStack(fused)
        # Tied to the embedding, the LM head packs a copy of its own (lookups read rows).
        tied = self.config.tie_word_embeddings
        self.logits_head.set_kernels(kernels, None if tied else self.lm_head.packed)

    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states [T, H] and the hidden states entering `batch.capture_layers`.

        Capture index i is the input of layer i (index `num_layers` is the last layer's output
        before the final norm), the same indexing as transformers' `output_hidden_states`.
        """
        ctx = LayerContext(batch, backend, self.rotary, self.kernels)
        if self.kernels is not None:
            decode = backend.decode_kernel_inputs(batch)
            if decode is not None and decode.kv_pool.dtype == self.embed_tokens.weight.dtype:
                ctx.decode = decode  # the fused layers write K and V in the pool as they are
        x = self.embed(batch.input_ids)
        residual: torch.Tensor | None = None
        captured: list[torch.Tensor] = []
        capture = batch.capture_layers
        if ctx.decode is not None and self.fused_stack is not None:
            pool = ctx.decode.kv_pool
            args = ctx.fused_args(pool.k, pool.v)
            x, residual, *captured = self.fused_stack.forward(x, *args, sorted(capture))
            return self.norm(x, residual)[0], captured
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured.append(x.clone() if residual is None else x + residual)
            x, residual = layer(x, residual, ctx)
        if self.config.num_layers in capture:
            captured.append(x + residual)
        return self.norm(x, residual)[0], captured

    def restrict_logits(self, ids: torch.Tensor) -> None:
        """From now on, logits [R, len(ids)] over the vocabulary rows `ids` only (a draft's hot
        vocabulary); the full head's packed copy is dropped."""
        self.logits_head = self.logits_head.restricted(ids)
        if not self.config.tie_word_embeddings:
            self.lm_head.packed = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [R, vocab] for the given rows of final hidden states."""
        logits = self.logits_head(hidden)
        return logits if self.tp is None else self.tp.gather(logits, self.config.vocab_size)
