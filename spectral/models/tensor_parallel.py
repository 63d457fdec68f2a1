"""A loaded Llama-family model cut down to one tensor-parallel rank's share, in place, before
its weights are packed (issue 43): q|k|v and gate|up keep this rank's output rows (whole heads;
KV heads split, or the one its query heads read replicated), o and down its input columns (their
outputs summed over ranks), the embedding and the LM head its rows of the vocabulary (looked
up and summed; logits gathered). Dense weights only so far; a model served from GGUF blocks is
refused."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from spectral.layers.linear import Linear
from spectral.layers.parallel import TensorParallel, head_share, shard_range
from spectral.models.config import ModelConfig


def _keep(linear: Linear, rows: list[slice] | None = None, cols: slice | None = None) -> None:
    """`linear` keeps the rows `rows` (joined in order) and the input columns `cols`."""
    weight = linear.weight.data
    if rows is not None:
        weight = torch.cat([weight[r] for r in rows])
        if linear.bias is not None:
            linear.bias = nn.Parameter(torch.cat([linear.bias.data[r] for r in rows]), False)
    if cols is not None:
        weight = weight[:, cols]
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def shard_llama(model: nn.Module, tp: TensorParallel) -> ModelConfig:
    """Cut `model` (a LlamaForCausalLM, dense, not yet packed) to rank `tp.rank`'s share and
    give it `tp`; returns the config its KV pool is sized by (this rank's heads)."""
    cfg: ModelConfig = model.config
    if any(getattr(m, "packed", None) is not None for m in model.modules()):
        raise ValueError("tensor parallelism cuts dense weights; this model's are packed or GGUF")
    share = head_share(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.world)
    D = cfg.head_dim
    q_size, kv_size = cfg.num_heads * D, cfg.num_kv_heads * D
    q = slice(share.q.start * D, share.q.stop * D)
    kv = slice(share.kv.start * D, share.kv.stop * D)
    kv_k = slice(q_size + kv.start, q_size + kv.stop)
    kv_v = slice(q_size + kv_size + kv.start, q_size + kv_size + kv.stop)
    inter = shard_range(cfg.intermediate_size, tp.rank, tp.world)
    up = slice(cfg.intermediate_size + inter.start, cfg.intermediate_size + inter.stop)
    heads, kv_heads = share.q.stop - share.q.start, share.kv.stop - share.kv.start
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep(attn.qkv_proj, rows=[q, kv_k, kv_v])
        _keep(attn.o_proj, cols=q)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.split = (heads * D, kv_heads * D, kv_heads * D)
        _keep(mlp.gate_up_proj, rows=[inter, up])
        _keep(mlp.down_proj, cols=inter)
        if mlp.down_proj.bias is not None and tp.rank:  # added once, after the sum
            mlp.down_proj.bias = None
        mlp.intermediate_size = inter.stop - inter.start
        attn.tp = mlp.tp = tp
    vocab = shard_range(cfg.vocab_size, tp.rank, tp.world)
    model.embed_tokens.weight = nn.Parameter(
        model.embed_tokens.weight.data[vocab].contiguous(), requires_grad=False
    )
    if not cfg.tie_word_embeddings:
        _keep(model.lm_head, rows=[vocab])
    model.vocab_start = vocab.start
    model.tp = tp
    return dataclasses.replace(
        cfg, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter.stop - inter.start
    )
