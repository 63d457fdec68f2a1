"""Tensor parallelism's pieces (spectral/layers/parallel.py): shares that cover every row and
column once, GGUF shares that dequantize (by gguf's own code) to the matching slices of the
whole weight, head shares with KV heads split or replicated, and two gloo ranks whose
column-parallel, row-parallel, vocab-parallel and gathered results equal one process's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spectral.layers.gguf_blocks import BLOCKS
from spectral.layers.parallel import (
    gather_columns,
    head_share,
    row_parallel_sum,
    shard_columns,
    shard_range,
    shard_rows,
    vocab_parallel_embed,
)
from tests.test_gguf_blocks import gguf_values, random_blocks


@pytest.mark.parametrize("size,unit", [(12, 1), (13, 1), (64, 8), (7, 1), (768, 256)])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shares_cover_every_item_once_in_whole_units(size: int, unit: int, world: int) -> None:
    if size // unit < world:
        with pytest.raises(ValueError, match="cannot be split"):
            shard_range(size, 0, world, unit)
        return
    shares = [shard_range(size, r, world, unit) for r in range(world)]
    covered = [i for s in shares for i in range(s.start, s.stop)]
    assert covered == list(range(size))
    counts = [(s.stop - s.start) // unit for s in shares]
    assert all((s.stop - s.start) % unit == 0 for s in shares)
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


def test_bad_splits_are_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="whole units of 32"):
        shard_range(100, 0, 2, 32)
    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        shard_range(10, 2, 2)
    with pytest.raises(ValueError, match="do not split over 2"):
        head_share(9, 3, 0, 2)
    with pytest.raises(ValueError, match="GGUF type Q2_K"):
        shard_columns(torch.zeros(2, 84, dtype=torch.uint8), 0, 2, "Q2_K")


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("world", [2, 3])
def test_gguf_shares_dequantize_to_slices_of_the_whole(fmt: str, world: int) -> None:
    size, nbytes = BLOCKS[fmt]
    raw = random_blocks(fmt, 6, 6, seed=world)
    whole = gguf_values(fmt, raw)
    for rank in range(world):
        cols = shard_columns(torch.from_numpy(raw), rank, world, fmt).numpy()
        k = shard_range(6 * size, rank, world, size)
        assert torch.equal(gguf_values(fmt, np.ascontiguousarray(cols)), whole[:, k])
        rows = shard_rows(torch.from_numpy(raw), rank, world).numpy()
        assert torch.equal(gguf_values(fmt, rows), whole[shard_range(6, rank, world)])


def test_head_shares_split_kv_heads_or_replicate_the_one_read() -> None:
    # 9 query heads over 3 KV heads (the default model), 3 ranks: one KV head each
    shares = [head_share(9, 3, r, 3) for r in range(3)]
    assert [(s.q.start, s.q.stop, s.kv.start, s.kv.stop) for s in shares] == [
        (0, 3, 0, 1),
        (3, 6, 1, 2),
        (6, 9, 2, 3),
    ]
    # 8 over 2 KV heads on 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    assert [head_share(8, 2, r, 4).kv.start for r in range(4)] == [0, 0, 1, 1]
    # 12 over 2 KV heads on 2 ranks (Qwen2.5-1.5B's 12/2): one KV head each
    assert [(head_share(12, 2, r, 2).kv.start) for r in range(2)] == [0, 1]


def _rank(rank: int, world: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # every rank builds the same whole tensors
        x = torch.randn(5, 24)
        up = torch.randn(40, 24)
        down = torch.randn(24, 40)
        table = torch.randn(11, 24)
        head = torch.randn(7, 24)
        ids = torch.tensor([0, 10, 3, 5, 5, 9])
        # an MLP: column-parallel up (rows), row-parallel down (its columns), one all-reduce
        h = torch.relu(x @ shard_rows(up, rank, world).T)
        out = row_parallel_sum(h @ shard_columns(down, rank, world).T)
        torch.testing.assert_close(out, torch.relu(x @ up.T) @ down.T, rtol=1e-5, atol=1e-4)
        rows = shard_range(11, rank, world)
        emb = vocab_parallel_embed(ids, shard_rows(table, rank, world), rows.start)
        assert torch.equal(emb, table[ids])
        logits = gather_columns(x @ shard_rows(head, rank, world).T)  # 7 = 4 + 3 columns
        torch.testing.assert_close(logits, x @ head.T, rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_one_process_results(tmp_path) -> None:
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2, join=True)
