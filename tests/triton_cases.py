"""Cases for spectral's Triton kernels, run by tests/test_triton_attention.py in a process of
their own: Triton's interpreter must be chosen (TRITON_INTERPRET=1) before triton is imported,
which the test process may have done already."""

from __future__ import annotations

import random
import sys

import torch

from spectral.forward import ForwardBatch, ForwardMode
from spectral.kernels.base import query_row_slots
from spectral.kernels.torch_backend import TorchAttentionBackend
from spectral.kernels.triton.attention import row_attention
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool
from spectral.speculative.tree import trees_from_parents

TOLERANCE = 1e-5


def run_case(
    rng: random.Random,
    mode: ForwardMode,
    prefixes: list[int],
    news: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> float:
    """Largest difference between the Triton kernel and the torch backend (SDPA under its
    masks) for one batch; the keys of the new tokens are written by the torch backend."""
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
        row = i + 1  # row 0 left unused
        slots = [free.pop() for _ in range(prefix + n)]
        table.write(row, 0, slots)
        rows.append(row)
        new_slots += slots[prefix:]
        if mode == ForwardMode.TARGET_VERIFY:
            parents = [rng.randrange(0, j + 1) for j in range(n - 1)]
            tree = trees_from_parents([1], [[2] * (n - 1)], [parents], n)
            masks.append(tree.mask[0].reshape(-1))
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
    scaling = head_dim**-0.5
    torch_backend = TorchAttentionBackend(pool, table, scaling, kernels=None)
    torch_backend.init_forward_metadata(batch)
    expected = torch_backend.forward(q, k, v, 0, batch)  # writes the new keys
    kv_indices, lens = query_row_slots(batch, table.table)
    got = row_attention(q, pool.k[0], pool.v[0], kv_indices, lens, scaling)
    return float((got.reshape(T, heads * head_dim) - expected).abs().max())


def main() -> int:
    rng = random.Random(0)
    cases = [
        (ForwardMode.EXTEND, [0, 0], [5, 17]),  # prefill, no prefix, ragged
        (ForwardMode.EXTEND, [9, 40, 0], [3, 1, 6]),  # over cached prefixes
        (ForwardMode.DECODE, [7, 70, 1, 33], [1, 1, 1, 1]),
        (ForwardMode.TARGET_VERIFY, [12, 45], [6, 9]),  # draft trees
    ]
    worst = 0.0
    for heads, kv_heads, head_dim in [(4, 2, 16), (3, 3, 24)]:  # GQA; MHA, a head_dim of 24
        for mode, prefixes, news in cases:
            err = run_case(rng, mode, prefixes, news, heads, kv_heads, head_dim)
            print(f"{mode.name:14s} heads {heads}/{kv_heads} dim {head_dim}: max error {err:.2e}")
            worst = max(worst, err)
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
