"""A Llama-family model cut down to one tensor-parallel rank's share, in place, before its
weights are packed (issue 43): q|k|v and gate|up keep this rank's output rows (whole heads; KV
heads split, or the one its query heads read replicated), o and down its input columns (their
outputs summed over ranks), the embedding and the LM head its rows of the vocabulary (looked
up and summed; logits gathered). A dense model is cut after loading; a GGUF model is cut as it
loads (`gguf_cuts`: each rank reads, packs and holds only its share of the blocks)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from spectral.layers.linear import Linear
from spectral.layers.parallel import TensorParallel, head_share, shard_range
from spectral.models.config import ModelConfig


@dataclass(frozen=True)
class LlamaShares:
    """Rank `tp.rank`'s share of a Llama-family model, in weights: the rows of q (its query
    heads' rows, also o's input columns), of k and of v (its KV heads'), of gate and of up (also
    down's input columns), of the vocabulary."""

    tp: TensorParallel
    q: slice
    kv: slice
    inter: slice
    vocab: slice
    heads: int
    kv_heads: int

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this rank's layers and KV pool are sized by."""
        return dataclasses.replace(
            cfg,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            intermediate_size=self.inter.stop - self.inter.start,
        )


def llama_shares(
    cfg: ModelConfig, tp: TensorParallel, attn_unit: int = 1, mlp_unit: int = 1
) -> LlamaShares:
    """Rank `tp.rank`'s share; o's input columns in whole `attn_unit`s and down's in whole
    `mlp_unit`s (their GGUF blocks' weights), or a ValueError saying what does not split."""
    share = head_share(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.world)
    D = cfg.head_dim
    q = slice(share.q.start * D, share.q.stop * D)
    if q.start % attn_unit or q.stop % attn_unit:
        raise ValueError(
            f"a rank's attention heads ({share.q.stop - share.q.start} x {D} inputs of the "
            f"attention output) are not whole GGUF blocks of {attn_unit} weights; use another "
            "--tp-size or --quantization none"
        )
    return LlamaShares(
        tp=tp,
        q=q,
        kv=slice(share.kv.start * D, share.kv.stop * D),
        inter=shard_range(cfg.intermediate_size, tp.rank, tp.world, mlp_unit),
        vocab=shard_range(cfg.vocab_size, tp.rank, tp.world),
        heads=share.q.stop - share.q.start,
        kv_heads=share.kv.stop - share.kv.start,
    )


def gguf_cuts(shares: LlamaShares) -> dict[str, tuple[slice | None, slice | None]]:
    """Per GGUF tensor kind (`attn_q`, `ffn_down`, `token_embd`, ...), the (rows, input
    columns) a rank keeps; kinds not named are kept whole (norms)."""
    return {
        "attn_q": (shares.q, None),
        "attn_k": (shares.kv, None),
        "attn_v": (shares.kv, None),
        "attn_output": (None, shares.q),
        "ffn_gate": (shares.inter, None),
        "ffn_up": (shares.inter, None),
        "ffn_down": (None, shares.inter),
        "token_embd": (shares.vocab, None),
        "output": (shares.vocab, None),
    }


def _keep(
    linear: Linear, rows: list[slice] | None = None, cols: slice | None = None, cut: bool = True
) -> None:
    """`linear` keeps the rows `rows` (joined in order) and the input columns `cols`; without
    `cut`, it gets empty tensors of that shape for a loader to fill."""
    weight, bias = linear.weight.data, linear.bias
    if not cut:
        n = sum(r.stop - r.start for r in rows) if rows else weight.shape[0]
        k = cols.stop - cols.start if cols else weight.shape[1]
        weight = torch.empty(n, k, dtype=weight.dtype)
        if bias is not None and rows:
            linear.bias = nn.Parameter(torch.empty(n, dtype=bias.dtype), False)
    else:
        if rows is not None:
            weight = torch.cat([weight[r] for r in rows])
            if bias is not None:
                linear.bias = nn.Parameter(torch.cat([bias.data[r] for r in rows]), False)
        if cols is not None:
            weight = weight[:, cols]
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def shard_llama(model: nn.Module, shares: LlamaShares, cut: bool = True) -> ModelConfig:
    """Cut `model` (a LlamaForCausalLM, not yet packed) to `shares` and give it their
    TensorParallel; without `cut`, only its shapes (empty weights a GGUF loader fills with its
    cut blocks). Returns the config its KV pool is sized by (this rank's heads)."""
    cfg: ModelConfig = model.config
    if any(getattr(m, "packed", None) is not None for m in model.modules()):
        raise ValueError("tensor parallelism cuts weights before they are packed")
    tp, D = shares.tp, cfg.head_dim
    q_size, kv_size = cfg.num_heads * D, cfg.num_kv_heads * D
    kv, inter = shares.kv, shares.inter
    kv_k = slice(q_size + kv.start, q_size + kv.stop)
    kv_v = slice(q_size + kv_size + kv.start, q_size + kv_size + kv.stop)
    up = slice(cfg.intermediate_size + inter.start, cfg.intermediate_size + inter.stop)
    heads, kv_heads = shares.heads, shares.kv_heads
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep(attn.qkv_proj, [shares.q, kv_k, kv_v], cut=cut)
        _keep(attn.o_proj, cols=shares.q, cut=cut)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.split = (heads * D, kv_heads * D, kv_heads * D)
        _keep(mlp.gate_up_proj, [inter, up], cut=cut)
        _keep(mlp.down_proj, cols=inter, cut=cut)
        if mlp.down_proj.bias is not None and tp.rank:  # added once, after the sum
            mlp.down_proj.bias = None
        mlp.intermediate_size = inter.stop - inter.start
        attn.tp = mlp.tp = tp
    vocab = shares.vocab
    table = model.embed_tokens.weight.data
    # a copy: a view of the rows would keep the whole table's storage alive
    rows = table[vocab].clone() if cut else torch.empty(vocab.stop - vocab.start, table.shape[1])
    model.embed_tokens.weight = nn.Parameter(rows.to(table.dtype), False)
    if not cfg.tie_word_embeddings:
        _keep(model.lm_head, [vocab], cut=cut)
    model.vocab_start = vocab.start
    model.tp, model.shares = tp, shares
    return shares.config(cfg)
