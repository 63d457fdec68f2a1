"""Cases for spectral's Triton kernels and backend, run by tests/test_triton_attention.py in a
process of their own: Triton's interpreter must be chosen (TRITON_INTERPRET=1) before triton
is imported, which the test process may have done already."""

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


def engines_agree() -> bool:
    """An Engine with --attention-backend triton gives the torch backend's greedy tokens on a
    tiny model with sharp distributions, plainly and with EAGLE3 (a random head, every step a
    tree round)."""
    import tempfile
    from pathlib import Path

    from spectral import Engine
    from spectral.models.resolve import resolve_model_path
    from tests.conftest import make_tiny_llama
    from tests.test_speculative import make_random_head

    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_llama(
        tmp / "model",
        resolve_model_path("default"),
        seed=1,
        initializer_range=1.0,
        max_position_embeddings=2048,
    )
    eagle3 = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": make_random_head(tmp / "head", model, "eagle3"),
        "speculative_fixed_tree": True,
        "speculative_max_batch_size": 4,
    }
    prompts = [[5, 6, 7, 8, 9], [12, 13]]
    outputs = []
    for backend in ("torch", "triton"):
        for spec in ({}, eagle3):
            engine = Engine(
                model_path=model,
                dtype="float32",
                max_total_tokens=1024,
                attention_backend=backend,
                **spec,
            )
            outs = engine.generate(
                input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 4}
            )
            rounds = engine.scheduler.stats.spec_verify_ct
            engine.shutdown()
            outputs.append([o["output_ids"] for o in outs])
            print(f"engine, {backend} attention, {'EAGLE3' if spec else 'plain'}: {outputs[-1]}")
            if spec and rounds == 0:
                print("no speculative round ran")
                return False
    return all(out == outputs[0] for out in outputs)


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
    return 0 if worst <= TOLERANCE and engines_agree() else 1


if __name__ == "__main__":
    sys.exit(main())
