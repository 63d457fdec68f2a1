"""Tensor parallelism's pieces (spectral/layers/parallel.py): shares that cover every row and
column once, GGUF shares that dequantize (by gguf's own code) to the matching slices of the
whole weight, head shares with KV heads split or replicated, two gloo ranks whose
column-parallel, row-parallel, vocab-parallel and gathered results equal one process's, and two
rank workers (dense, or GGUF blocks cut as they load) that decode as one."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spectral.layers.gguf_blocks import BLOCKS
from spectral.layers.parallel import (
    block_columns,
    gather_columns,
    head_share,
    row_parallel_sum,
    shard_range,
    vocab_parallel_embed,
)
from spectral.models.gguf_native import GGUFWeights
from spectral.models.resolve import model_files_dir
from tests.gguf_models import write_tiny_gguf
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
    with pytest.raises(ValueError, match="columns 0..128 are not whole Q4_K blocks"):
        block_columns("Q4_K", slice(0, 128))


def cut_rows(fmt: str, raw: np.ndarray, rows: slice | None, cols: slice | None) -> np.ndarray:
    """spectral's cut of a GGUF tensor for one rank (GGUFWeights.rows_of under `cuts`), from
    a reader holding `raw` as gguf's reader gives a tensor (rows of blocks, or values)."""
    name = "blk.0.ffn_down.weight"
    kind = gguf.GGMLQuantizationType[fmt]
    reader = SimpleNamespace(tensors=[SimpleNamespace(name=name, data=raw, tensor_type=kind)])
    weights = GGUFWeights(
        reader, "x.gguf", None, False, None, {"ffn_down": (rows, cols)}, {}, torch.float32
    )
    return weights.rows_of(name)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q4_K", "Q6_K", "F32"])
@pytest.mark.parametrize("world", [2, 3])
def test_gguf_shares_dequantize_to_slices_of_the_whole(fmt: str, world: int) -> None:
    """Each rank's cut of a GGUF tensor as spectral makes it (its whole-block columns, or
    its rows) dequantizes, by gguf's own code, to its columns (rows) of gguf's dequantization
    of the whole weight."""
    if fmt == "F32":
        size, raw = 32, np.random.default_rng(world).standard_normal((6, 6 * 32), np.float32)
        whole = torch.from_numpy(raw)
    else:
        size = BLOCKS[fmt][0]
        raw = random_blocks(fmt, 6, 6, seed=world)
        whole = gguf_values(fmt, raw)

    def values(cut: np.ndarray) -> torch.Tensor:
        cut = np.ascontiguousarray(cut)
        return torch.from_numpy(cut) if fmt == "F32" else gguf_values(fmt, cut)

    for rank in range(world):
        k = shard_range(6 * size, rank, world, size)
        assert torch.equal(values(cut_rows(fmt, raw, None, k)), whole[:, k])
        rows = shard_range(6, rank, world)
        assert torch.equal(values(cut_rows(fmt, raw, rows, None)), whole[rows])


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
        inter = shard_range(40, rank, world)
        h = torch.relu(x @ up[inter].T)
        out = row_parallel_sum(h @ down[:, inter].T)
        torch.testing.assert_close(out, torch.relu(x @ up.T) @ down.T, rtol=1e-5, atol=1e-4)
        rows = shard_range(11, rank, world)
        emb = vocab_parallel_embed(ids, table[rows], rows.start)
        assert torch.equal(emb, table[ids])
        logits = gather_columns(x @ head[shard_range(7, rank, world)].T, 7)  # 4 + 3 columns
        torch.testing.assert_close(logits, x @ head.T, rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_one_process_results(tmp_path) -> None:
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2, join=True)


def _worker_rank(
    rank: int, world: int, init: str, cases: list[tuple[str, dict]], backend: str = "gloo"
) -> None:
    """Rank `rank` of `world` in one group, for each (model_dir, options) case in turn: a
    whole ModelWorker and a tensor-parallel one decode as one (`_decode_as_one`); `backend`
    nccl: each rank on its own GPU."""
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = "cuda"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        for model_dir, options in cases:
            _decode_as_one(rank, world, device, model_dir, options)
    finally:
        # the workers' cycles hold the group: collected at exit, after destroy_process_group,
        # gloo's threads abort the process (std::terminate) one run in five
        gc.collect()
        dist.destroy_process_group()


def _decode_as_one(rank: int, world: int, device: str, model_dir: str, options: dict) -> None:
    """A whole ModelWorker and a tensor-parallel one (`options` for both; on a GPU the weights
    random from one seed) decode the same three requests alike."""
    from spectral.core.forward import ForwardMode
    from spectral.core.worker_io import RequestSampling, WorkerBatch
    from spectral.layers.linear import weight_bytes
    from spectral.layers.parallel import TensorParallel
    from spectral.sampling_params import SamplingParams
    from spectral.worker.model_worker import ModelWorker

    common = dict(
        model_dir=model_dir,
        dtype=torch.float32,
        device=device,
        max_total_tokens=512,
        max_running_requests=4,
        max_context_len=256,
        **options,
    )
    whole = ModelWorker(**common)
    mine = ModelWorker(**common, tensor_parallel=TensorParallel(rank, world))
    held, full = weight_bytes(mine.model), weight_bytes(whole.model)
    # the norms (and an embedding looked up from its blocks) are all every rank holds whole
    assert held < 0.6 * full, (held, full)
    if options.get("gguf_file") and options.get("gguf_native", True):
        layer = mine.model.layers[0]
        assert layer.mlp.down_proj.packed is not None  # served from its cut blocks
        assert layer.self_attn.qkv_proj.weight.numel() == 0
    assert mine.kv_pool.k[0].shape[1] * world == whole.kv_pool.k[0].shape[1]
    greedy = RequestSampling(SamplingParams(temperature=0.0, max_new_tokens=16))
    vocab = whole.config.vocab_size
    prompts = [[t % vocab for t in p] for p in ([5, 9, 300, 41, 7], [1000, 2, 3], [17] * 9)]
    lens = [len(p) for p in prompts]
    slots = [list(range(1 + 64 * b, 1 + 64 * b + n)) for b, n in enumerate(lens)]
    batch = WorkerBatch(
        ForwardMode.EXTEND,
        [t for p in prompts for t in p],
        [i for n in lens for i in range(n)],
        [s for row in slots for s in row],
        [0, 1, 2],
        [0, 0, 0],
        lens,
        [greedy] * 3,
    )
    outputs = []
    for worker in (whole, mine):
        steps = []
        wb = batch
        for step in range(10):
            result, _, hidden, _ = worker.run(wb)
            steps.append((result.next_token_ids, worker.model.compute_logits(hidden).cpu()))
            now = [n + step for n in lens]
            wb = WorkerBatch(
                ForwardMode.DECODE,
                result.next_token_ids,
                now,
                [1 + 64 * b + n for b, n in enumerate(now)],
                [0, 1, 2],
                now,
                [1, 1, 1],
                [greedy] * 3,
            )
        outputs.append(steps)
    for (ids, logits), (tp_ids, tp_logits) in zip(*outputs):
        assert tp_ids == ids
        torch.testing.assert_close(tp_logits, logits, rtol=1e-4, atol=1e-4)


# (architecture, GGUF format, worker options): blocks served as they are, through the integer
# path, and dequantized at load; llama's q and k rows are permuted in the file, qwen2 has biases
GGUF_CASES = {
    "qwen2-Q8_0": ("qwen2", "Q8_0", {}),
    "llama-Q4_0-int8": ("llama", "Q4_0", {"gguf_int8": True}),
    "llama-Q5_0-dequantized": ("llama", "Q5_0", {"gguf_native": False}),
}


def test_two_rank_workers_decode_as_one_holding_half_the_weights_each(
    tmp_path, peaky_model_dir: str
) -> None:
    """Two tensor-parallel ModelWorkers (gloo, the CPU kernels on) on the peaky model (4
    query and 2 KV heads, one KV head a rank) and on tiny GGUFs (cut as they load: each rank
    reads and packs only its blocks): a prefill and 10 greedy decode steps of three requests
    give one worker's tokens and logits, each rank holding about half the weights and half
    the KV heads. The cases run in one pair of rank processes."""
    cases = [(peaky_model_dir, {})]
    for name, (arch, fmt, options) in GGUF_CASES.items():
        path = write_tiny_gguf(tmp_path / f"{name}.gguf", arch, fmt, seed=2)
        model_dir = model_files_dir(str(path), str(tmp_path / "cache"))
        cases.append((model_dir, {**options, "gguf_file": str(path)}))
    mp.spawn(
        _worker_rank,
        args=(2, f"file://{tmp_path / 'rendezvous'}", cases),
        nprocs=2,
        join=True,
    )


def test_a_gguf_whose_blocks_straddle_a_ranks_heads_is_refused(tmp_path) -> None:
    """Q4_K's blocks hold 256 inputs; a rank's 2 heads of 64 give the attention output 128."""
    from spectral.layers.parallel import TensorParallel
    from spectral.worker.model_worker import ModelWorker

    path = write_tiny_gguf(tmp_path / "k.gguf", "llama", "Q4_K_M")
    with pytest.raises(ValueError, match="not whole GGUF blocks of 256 weights"):
        ModelWorker(
            model_files_dir(str(path), str(tmp_path / "cache")),
            torch.float32,
            "cpu",
            512,
            4,
            256,
            gguf_file=str(path),
            tensor_parallel=TensorParallel(0, 2),
        )
