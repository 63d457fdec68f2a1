"""Tensor parallelism's pieces (Megatron's split, over torch.distributed; issue 43's first step):
which share of a weight each of `world` ranks holds, and the collectives that join the ranks'
partial results. Shares are taken from the weights as stored, before they are packed for the
kernels, so that each rank packs and holds only its own:

- column-parallel (q|k|v, gate|up): whole output rows, by whole heads for attention; each rank
  computes its rows' outputs, no collective;
- row-parallel (o, down): whole input columns (GGUF: whole blocks, so each rank's columns are a
  multiple of the block's weights); each rank's partial product is summed (`all_reduce`);
- vocab-parallel embedding: whole rows of the table; a rank looks up the ids in its range and
  the ranks' rows are summed; the LM head's logits are gathered (`all_gather`) in rank order.

Shares are contiguous and as even as whole units allow (the first ranks take one unit more).
A model with fewer KV heads than ranks gives each rank the KV head its query heads read
(replicated), as SGLang and vLLM do."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch
import torch.distributed as dist


def shard_range(size: int, rank: int, world: int, unit: int = 1) -> slice:
    """Rank `rank`'s contiguous share of `size` items, in whole `unit`s."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of {world} ranks")
    if size % unit:
        raise ValueError(f"{size} items do not split into whole units of {unit}")
    units = size // unit
    if units < world:
        raise ValueError(f"{units} units of {unit} cannot be split over {world} ranks")
    base, extra = divmod(units, world)
    start = rank * base + min(rank, extra)
    return slice(start * unit, (start + base + (rank < extra)) * unit)


def block_shape(kind: str) -> tuple[int, int]:
    """(weights, bytes) of one block of GGUF format `kind` (one weight for float formats)."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]


def block_columns(kind: str, cols: slice) -> slice:
    """A row-parallel share of a GGUF row of format `kind` as gguf's reader gives it: where
    input columns `cols` lie, in bytes of whole blocks (the values themselves for float
    formats)."""
    weights, nbytes = block_shape(kind)
    if weights == 1:
        return cols
    if cols.start % weights or cols.stop % weights:
        raise ValueError(f"columns {cols.start}..{cols.stop} are not whole {kind} blocks")
    return slice(cols.start // weights * nbytes, cols.stop // weights * nbytes)


@dataclass(frozen=True)
class HeadShare:
    """The attention heads rank `rank` computes: query heads [q.start, q.stop) and KV heads
    [kv.start, kv.stop) of the model's."""

    q: slice
    kv: slice


def head_share(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShare:
    """Query heads split evenly; KV heads split with them, or, where there are fewer KV heads
    than ranks, the one KV head this rank's query heads read (replicated on the ranks that
    share it)."""
    if num_heads % world:
        raise ValueError(f"{num_heads} attention heads do not split over {world} ranks")
    q = shard_range(num_heads, rank, world)
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {world} ranks")
        return HeadShare(q, shard_range(num_kv_heads, rank, world))
    first = q.start // group
    if (q.stop - 1) // group != first:
        raise ValueError(
            f"a rank's {q.stop - q.start} query heads read more than one of {num_kv_heads} KV heads"
        )
    return HeadShare(q, slice(first, first + 1))


def row_parallel_sum(partial: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum over ranks of their partial products (in place)."""
    dist.all_reduce(partial, group=group)
    return partial


def vocab_parallel_embed(
    ids: torch.Tensor,
    rows: torch.Tensor,
    start: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Embeddings of `ids` where this rank holds the table's rows [start, start + len(rows)):
    its own ids looked up, zeros for the others', summed over ranks."""
    local = ids - start
    mine = (local >= 0) & (local < rows.shape[0])
    out = rows[local.clamp(0, rows.shape[0] - 1)] * mine[:, None].to(rows.dtype)
    return row_parallel_sum(out, group)


def gather_columns(
    part: torch.Tensor, total: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Every rank's [m, n_r] columns side by side in rank order (the LM head's logits), where
    the ranks hold `shard_range` shares of `total` columns (so they may differ by one)."""
    world = dist.get_world_size(group)
    shares = [shard_range(total, r, world) for r in range(world)]
    widths = [share.stop - share.start for share in shares]
    padded = torch.nn.functional.pad(part, (0, widths[0] - part.shape[1]))  # the first: widest
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank `rank` of `world`, collectives
    over `group` (None: torch.distributed's default group)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        return row_parallel_sum(partial, self.group)

    def embed(self, ids: torch.Tensor, rows: torch.Tensor, start: int) -> torch.Tensor:
        return vocab_parallel_embed(ids, rows, start, self.group)

    def gather(self, part: torch.Tensor, total: int) -> torch.Tensor:
        return gather_columns(part, total, self.group)

    def broadcast(self, value: int) -> int:
        """Rank 0's `value` on every rank (a tensor where the backend wants it: NCCL's on
        this rank's GPU)."""
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(tensor, 0, group=self.group)
        return int(tensor.item())
