"""Random attention batches over a paged KV pool, for testing backends against the torch one."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool
from spectral.speculative.tree import DraftTrees, select_eagle_trees


@dataclass
class AttentionCase:
    pool: KVPool  # one layer, random K/V in every slot
    table: ReqToTokenPool  # each request's prefix and new slots written, shuffled across the pool
    batch: ForwardBatch
    q: torch.Tensor  # [T, heads, head_dim]
    k: torch.Tensor  # [T, kv_heads, head_dim], the new tokens' keys (not yet in the pool)
    v: torch.Tensor
    scaling: float

    def to(self, device: str, dtype: torch.dtype) -> AttentionCase:
        """The same case on `device` with the pool, q, k and v in `dtype`."""
        pool = KVPool(self.pool.num_slots, 1, *self.pool.k[0].shape[1:], dtype, device)
        pool.k[0].copy_(self.pool.k[0])
        pool.v[0].copy_(self.pool.v[0])
        table = ReqToTokenPool(self.table.max_requests, self.table.max_context_len, device)
        table.table.copy_(self.table.table)
        b = self.batch
        moved = dataclasses.replace(
            b,
            input_ids=b.input_ids.to(device),
            positions=b.positions.to(device),
            out_cache_loc=b.out_cache_loc.to(device),
            req_pool_indices=b.req_pool_indices.to(device),
            custom_mask=None if b.custom_mask is None else b.custom_mask.to(device),
            attn_metadata=None,
        )
        q, k, v = (t.to(device, dtype) for t in (self.q, self.k, self.v))
        return AttentionCase(pool, table, moved, q, k, v, self.scaling)


def random_case(
    rng: random.Random,
    mode: ForwardMode,
    prefixes: list[int],
    news: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> AttentionCase:
    """A batch of `mode` whose request i has prefixes[i] cached tokens and news[i] new ones (in
    the custom-mask modes, an EAGLE-2 tree of news[i] nodes), in table rows from 1 (row 0
    unused)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    total = sum(p + n for p, n in zip(prefixes, news))
    pool = KVPool(total + 8, 1, kv_heads, head_dim, torch.float32, "cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    table = ReqToTokenPool(len(prefixes) + 2, max(p + n for p, n in zip(prefixes, news)) + 1)
    free = list(range(1, total + 8))
    rng.shuffle(free)
    rows, new_slots, masks = [], [], []
    for i, (prefix, n) in enumerate(zip(prefixes, news)):
        row = i + 1
        slots = [free.pop() for _ in range(prefix + n)]
        table.write(row, 0, slots)
        rows.append(row)
        new_slots += slots[prefix:]
        if mode.uses_custom_mask():
            masks.append(eagle_tree(rng, n).mask[0, :n, :n].reshape(-1))
    T = sum(news)
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(T, dtype=torch.int64),
        positions=torch.zeros(T, dtype=torch.int64),
        out_cache_loc=torch.tensor(new_slots),
        req_pool_indices=torch.tensor(rows),
        prefix_lens=prefixes,
        extend_lens=news,
        custom_mask=torch.cat(masks) if masks else None,
    )
    q = torch.randn((T, heads, head_dim), generator=gen)
    k = torch.randn((T, kv_heads, head_dim), generator=gen)
    v = torch.randn((T, kv_heads, head_dim), generator=gen)
    return AttentionCase(pool, table, batch, q, k, v, head_dim**-0.5)


def eagle_tree(rng: random.Random, n: int) -> DraftTrees:
    """A tree of n nodes (root included) as the EAGLE-2 selection keeps it: the best n - 1 of
    2n random candidates, each scoring below its parent."""
    scores: list[float] = []
    parents: list[int] = []
    for c in range(2 * n):
        parent = rng.randrange(-1, c) if c else -1
        scores.append((scores[parent] if parent >= 0 else 0.0) - rng.random() * 2)
        parents.append(parent)
    tokens = [10 * c + rng.randrange(5) for c in range(2 * n)]
    tree = select_eagle_trees(
        torch.tensor([1]),
        torch.tensor([scores]),
        torch.tensor([tokens]),
        torch.tensor([parents]),
        n,
    )
    assert tree.num_nodes[0] == n
    return tree


# (mode, prefix lengths, new-token counts): ragged batches of every mode, prefixes of 0 and > 0.
CASES = [
    (ForwardMode.EXTEND, [0, 0], [5, 17]),
    (ForwardMode.EXTEND, [9, 40, 0], [3, 1, 6]),
    (ForwardMode.DECODE, [7, 70, 1, 33], [1, 1, 1, 1]),
    (ForwardMode.TARGET_VERIFY, [12, 45], [6, 9]),
    (ForwardMode.EXTEND, [0, 3], [40, 37]),  # several tiles of new tokens per request
    (ForwardMode.TARGET_VERIFY, [0, 5], [20, 33]),
]
# (heads, kv heads, head dim): GQA; MHA with a head dim of 24.
SHAPES = [(4, 2, 16), (3, 3, 24)]
