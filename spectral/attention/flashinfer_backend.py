"""`--attention-backend flashinfer`: FlashInfer's paged-KV wrappers on CUDA, page size 1.

DECODE through the batch decode wrapper, TARGET_VERIFY through the Triton backend's tree
kernel (it reads lengths from the device, so a verify over static buffers replays a CUDA graph
too), every other mode through the batch prefill wrapper (causal, or under a draft head's tree
mask). `plan_arrays` builds what the wrappers are planned with, on any device. The kernels
take float16 and bfloat16 only: `auto` picks Triton for a float32 pool.
Decode steps in static buffers (a CUDA graph's) go through one decode wrapper per batch size
in FlashInfer's CUDA-graph mode, planned on the host before each replay into buffers of fixed
address (`prepare_replay`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from spectral.attention.base import StoreThenAttend, request_mask, request_slots
from spectral.attention.triton_backend import TritonAttentionBackend
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.transfer import pinned
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool

WORKSPACE_BYTES = 128 * 1024 * 1024
DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlashInferPlan:
    """FlashInfer's CSR description of one batch with pages of one token: request i's new
    tokens are query rows `qo_indptr[i]:qo_indptr[i+1]`, its keys the pages (= KV slots)
    `kv_indices[kv_indptr[i]:kv_indptr[i+1]]`, prefix first. `custom_mask` (custom-mask modes)
    concatenates each request's flattened bool [new tokens, keys] (True = attend) from bit
    `mask_indptr[i]`; without it new tokens are causal among themselves over the prefix."""

    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    custom_mask: torch.Tensor | None = None  # [mask_indptr[-1]] bool
    mask_indptr: torch.Tensor | None = None  # [B + 1] int32


def plan_arrays(batch: ForwardBatch, table: torch.Tensor) -> FlashInferPlan:
    """The plan of `batch`, whose slots `table` (the req-to-token table) already holds."""
    device = table.device
    slots, seq_lens = request_slots(batch, table)
    new = torch.tensor(batch.extend_lens, dtype=torch.int64, device=device)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    in_row = torch.arange(slots.shape[1], device=device)[None, :] < seq_lens[:, None]
    plan = FlashInferPlan(
        qo_indptr=torch.cat((zero, new.cumsum(0))).to(torch.int32),
        kv_indptr=torch.cat((zero, seq_lens.cumsum(0))).to(torch.int32),
        kv_indices=slots[in_row].to(torch.int32),
        kv_last_page_len=torch.ones(batch.batch_size, dtype=torch.int32, device=device),
    )
    if batch.custom_mask is None:
        return plan
    blocks, offset = [], 0
    for p, n in zip(batch.prefix_lens, batch.extend_lens):
        custom = batch.custom_mask[offset : offset + n * n].view(n, n).to(device)
        blocks.append(request_mask(p, n, custom, device).reshape(-1))
        offset += n * n
    mask_indptr = torch.cat((zero, (new * seq_lens).cumsum(0))).to(torch.int32)
    return dataclasses.replace(plan, custom_mask=torch.cat(blocks), mask_indptr=mask_indptr)


@dataclass(frozen=True)
class GraphDecode:
    """A static decode batch's metadata: its wrapper, planned by `prepare_replay`."""

    wrapper: object


def gathered_slots(
    rows: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor, total: int
) -> torch.Tensor:
    """The KV slots of requests in table `rows`, `seq_lens` each (device tensors; `total`
    their sum, known on the host), concatenated as int32, with no wait for the device."""
    row_of = rows.repeat_interleave(seq_lens, output_size=total)
    starts = seq_lens.cumsum(0) - seq_lens
    column = torch.arange(total, device=table.device) - starts.repeat_interleave(
        seq_lens, output_size=total
    )
    return table[row_of, column].to(torch.int32)


class FlashInferAttentionBackend(StoreThenAttend):
    """Plans its wrapper at the first layer of each forward (when the query heads are known)
    and runs it at every layer over the pool's K and V viewed as pages of one token."""

    capturable_modes = frozenset((ForwardMode.DECODE, ForwardMode.TARGET_VERIFY))

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        scaling: float,
        num_heads: int | None = None,
    ) -> None:
        """`num_heads` (query heads) is needed only to plan static decode batches."""
        super().__init__(kv_pool, req_to_token, scaling)
        self.num_heads = num_heads
        if kv_pool.dtype not in DTYPES:
            raise ValueError(
                f"the flashinfer backend takes a float16 or bfloat16 KV cache (got "
                f"{kv_pool.dtype}); use --attention-backend triton for float32"
            )
        import flashinfer

        device = kv_pool.k[0].device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # FA2 kernels: they take custom masks, and the decode wrapper's tensor-core path builds
        # the same JIT module (one per dtype and head dim, compiled once).
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2"
        )
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        self._planned: object = None
        # CUDA-graph mode: a decode wrapper per batch size over shared buffers (one static
        # batch replays at a time)
        self._graph_wrappers: dict[int, object] = {}
        self._graph_buffers: tuple[torch.Tensor, ...] | None = None
        # Tree verification: the Triton kernel reads the table and lengths from the device
        # (FlashInfer's prefill wrapper plans from host arrays, so it cannot replay).
        self.tree = TritonAttentionBackend(kv_pool, req_to_token, scaling)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.TARGET_VERIFY:
            self.tree.init_forward_metadata(batch)
            return
        if batch.seq_lens_tensor is not None and batch.mode.is_decode():
            batch.attn_metadata = GraphDecode(self._graph_wrapper(batch.batch_size))
            return
        batch.attn_metadata = plan_arrays(batch, self.req_to_token.table)
        self._planned = None

    def prepare_replay(self, batch: ForwardBatch) -> None:
        """Plan the static decode batch's wrapper: lengths from the host's lists, slots
        gathered on the device into the wrapper's buffer. Other modes plan as they run."""
        if not batch.mode.is_decode():
            return
        seq_lens = [p + 1 for p in batch.prefix_lens]
        total = sum(seq_lens)
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(seq_lens, dtype=torch.int32).cumsum(0)
        slots = gathered_slots(
            batch.req_pool_indices, batch.seq_lens_tensor, self.req_to_token.table, total
        )
        _, num_kv_heads, head_dim = self.kv_pool.k[0].shape
        dtype = self.kv_pool.dtype
        device = slots.device
        self._graph_wrapper(batch.batch_size).plan(
            pinned(indptr, device),
            slots,
            pinned(torch.ones(len(seq_lens), dtype=torch.int32), device),
            self.num_heads,
            num_kv_heads,
            head_dim,
            1,  # page size
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=self.scaling,
            non_blocking=True,
        )

    def _graph_wrapper(self, batch_size: int) -> object:
        """The CUDA-graph-mode decode wrapper of `batch_size` requests (made once)."""
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is not None:
            return wrapper
        if self.num_heads is None:
            raise ValueError("a static decode batch needs the backend built with num_heads")
        import flashinfer

        table = self.req_to_token.table
        if self._graph_buffers is None:
            rows, width = table.shape
            self._graph_buffers = (
                torch.zeros(rows + 1, dtype=torch.int32, device=table.device),
                torch.zeros(rows * width, dtype=torch.int32, device=table.device),
                torch.ones(rows, dtype=torch.int32, device=table.device),
            )
        indptr, indices, last_page_len = self._graph_buffers
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr[: batch_size + 1],
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len[:batch_size],
        )
        self._graph_wrappers[batch_size] = wrapper
        return wrapper

    def _plan(self, plan: FlashInferPlan, num_heads: int, batch: ForwardBatch) -> object:
        _, num_kv_heads, head_dim = self.kv_pool.k[0].shape
        dtype = self.kv_pool.dtype
        layout = (
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_last_page_len,
            num_heads,
            num_kv_heads,
            head_dim,
            1,  # page size
        )
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scaling)
        if batch.mode.is_decode():
            self.decode.plan(*layout, **common)
            return self.decode
        # The unpacked mask: FlashInfer packs it per request itself (its indptr in bytes).
        self.prefill.plan(
            plan.qo_indptr,
            *layout,
            custom_mask=plan.custom_mask,
            causal=plan.custom_mask is None,
            **common,
        )
        return self.prefill

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        if batch.mode == ForwardMode.TARGET_VERIFY:
            return self.tree.attend(q, layer_id, batch)
        meta = batch.attn_metadata
        if isinstance(meta, GraphDecode):
            planned = meta.wrapper
        else:
            if self._planned is None:
                self._planned = self._plan(meta, q.shape[1], batch)
            planned = self._planned
        pages = (self.kv_pool.k[layer_id].unsqueeze(1), self.kv_pool.v[layer_id].unsqueeze(1))
        out = planned.run(q.to(self.kv_pool.dtype).contiguous(), pages)
        return out.reshape(q.shape[0], -1).to(q.dtype)
