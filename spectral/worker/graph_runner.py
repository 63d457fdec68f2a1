"""The target's DECODE and TARGET_VERIFY forwards through static buffers, one CUDA graph per
bucket.

A bucket is a number of requests and of tokens a request: one for decode, a tree's nodes for
verification. A batch runs in the smallest bucket that holds it: its requests first, then
padded requests (the req-to-token table's dummy row, KV slot 0, one key); each request's tree
filled up to the bucket's size with nodes that see only themselves and write slot 0. The real
rows' outputs are sliced back. Where the attention backend can be captured on a GPU, each
bucket's forward (attention metadata from the static buffers, the layers, the LM head) is
captured once at start, largest first, into one memory pool, and replayed; elsewhere the same
static-buffer path runs eagerly, which is how it is tested on a CPU.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from spectral.attention.base import AttentionBackend
from spectral.core.cuda_graphs import StaticGraphs
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.transfer import stage
from spectral.mem.req_to_token import ReqToTokenPool
from spectral.speculative.tree import tree_mask_places

# Batch sizes captured (SGLang's spacing: every size up to 4, then wider steps), capped by
# --cuda-graph-max-bs; tree sizes of verification buckets.
DEFAULT_BATCH_SIZES = (1, 2, 3, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160)
TREE_SIZES = (2, 4, 8, 16, 32, 64)
# Verification buckets hold at most this many tokens: past it a forward is compute-bound and
# a graph saves little but its memory.
MAX_VERIFY_TOKENS = 512


@dataclass(frozen=True, order=True)
class Bucket:
    tokens: int  # a request's tokens: 1 for decode, else the verified tree's nodes
    requests: int

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.DECODE if self.tokens == 1 else ForwardMode.TARGET_VERIFY

    @property
    def num_tokens(self) -> int:
        return self.tokens * self.requests


def default_max_batch_size(device: str, max_running_requests: int) -> int:
    """--cuda-graph-max-bs when not given: what the GPU's free memory suits (graphs of large
    buckets hold large activations), at most the running requests."""
    if not device.startswith("cuda"):
        return min(max_running_requests, 64)
    free, _ = torch.cuda.mem_get_info()
    cap = 160 if free > 40 * 2**30 else 64 if free > 12 * 2**30 else 16
    return min(max_running_requests, cap)


def plan_buckets(
    batch_sizes: list[int], max_tree_tokens: int, verify_max_batch_size: int | None
) -> list[Bucket]:
    """Decode buckets of `batch_sizes`; with speculation (`max_tree_tokens` > 1), verification
    buckets of each tree size in TREE_SIZES up to it (and it), of the batch sizes up to
    `verify_max_batch_size`, holding at most MAX_VERIFY_TOKENS tokens."""
    buckets = [Bucket(1, bs) for bs in batch_sizes]
    if max_tree_tokens > 1:
        trees = sorted({n for n in TREE_SIZES if n < max_tree_tokens} | {max_tree_tokens})
        cap = verify_max_batch_size or max(batch_sizes)
        for n in trees:
            for bs in batch_sizes:
                if bs <= cap and n * bs <= MAX_VERIFY_TOKENS:
                    buckets.append(Bucket(n, bs))
    return sorted(buckets)


class StaticInputs:
    """The buffers every bucket's forward reads, sized for the largest: token ids, positions,
    KV slots (`max_tokens`), table rows and sequence lengths (`max_requests`), and the tree
    masks of the verification buckets."""

    def __init__(
        self, max_tokens: int, max_requests: int, max_mask: int, device: str | torch.device
    ) -> None:
        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.input_ids = ints(max_tokens)
        self.positions = ints(max_tokens)
        self.out_cache_loc = ints(max_tokens)
        self.req_pool_indices = ints(max_requests)
        self.seq_lens = ints(max_requests)
        self.custom_mask = torch.zeros(max(max_mask, 1), dtype=torch.bool, device=device)

    def batch(self, bucket: Bucket, capture_layers: tuple[int, ...]) -> ForwardBatch:
        """The bucket's forward batch: views of the buffers (every request padded)."""
        t, bs, n = bucket.num_tokens, bucket.requests, bucket.tokens
        verify = bucket.mode == ForwardMode.TARGET_VERIFY
        return ForwardBatch(
            mode=bucket.mode,
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            out_cache_loc=self.out_cache_loc[:t],
            req_pool_indices=self.req_pool_indices[:bs],
            prefix_lens=[0] * bs,
            extend_lens=[n] * bs,
            custom_mask=self.custom_mask[: bs * n * n] if verify else None,
            logits_rows="all",
            capture_layers=capture_layers,
            seq_lens_tensor=self.seq_lens[:bs],
        )


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]


class GraphRunner(StaticGraphs):
    """Runs the batches a bucket holds through static buffers (`run`), replaying captured
    CUDA graphs where `capture` was done; `None` from `bucket_for` sends a batch the eager way.
    Outputs are the real rows' final hidden states and captured layer inputs (copies the
    caller may keep) and logits (a view valid until the next replay)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        req_to_token: ReqToTokenPool,
        buckets: list[Bucket],
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.model = model
        self.backend = backend
        self.req_to_token = req_to_token
        self.buckets = sorted(buckets)
        self.capture_layers = capture_layers
        device = req_to_token.table.device
        self.device = device
        verify = [b for b in self.buckets if b.mode == ForwardMode.TARGET_VERIFY]
        self.inputs = StaticInputs(
            max(b.num_tokens for b in self.buckets),
            max(b.requests for b in self.buckets),
            max((b.requests * b.tokens * b.tokens for b in verify), default=0),
            device,
        )
        self.batches = {b: self.inputs.batch(b, capture_layers) for b in self.buckets}
        # batch sizes by tokens a request, ascending, for the bucket search
        self._sizes: dict[int, list[int]] = {}
        for b in self.buckets:
            self._sizes.setdefault(b.tokens, []).append(b.requests)
        self._tree_sizes = sorted(self._sizes)
        # per tree size, the mask of nodes that see only themselves (padding), made once
        self._self_only = {
            n: torch.eye(n, dtype=torch.bool, device=device) for n in self._tree_sizes if n > 1
        }
        self.graphs: dict[Bucket, Captured] = {}
        # on a GPU, with a backend that plans a replay on the host, recorded after each plan
        # (`run` waits for it before the next)
        plans = type(backend).prepare_replay is not AttentionBackend.prepare_replay
        self.plan_copied = torch.cuda.Event() if device.type == "cuda" and plans else None

    # ---- which bucket ------------------------------------------------------------------------

    def bucket_for(self, batch: ForwardBatch) -> Bucket | None:
        """The smallest bucket that holds `batch`, or None (another mode, more requests or a
        larger tree than any bucket, other captured layers)."""
        if batch.capture_layers != self.capture_layers:
            return None
        if batch.mode == ForwardMode.DECODE:
            tokens = 1
        elif batch.mode == ForwardMode.TARGET_VERIFY:
            largest = max(batch.extend_lens)
            i = bisect.bisect_left(self._tree_sizes, max(largest, 2))
            if i == len(self._tree_sizes):
                return None
            tokens = self._tree_sizes[i]
        else:
            return None
        if max(batch.prefix_lens) + tokens > self.req_to_token.max_context_len:
            return None  # a padded tree would run past the table's row
        sizes = self._sizes.get(tokens, [])
        j = bisect.bisect_left(sizes, batch.batch_size)
        return Bucket(tokens, sizes[j]) if j < len(sizes) else None

    # ---- capture -----------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's forward in a CUDA graph, largest first, in one memory pool
        (CUDA only). Each bucket runs twice eagerly first (kernel builds, autotuning)."""

        def prepare(bucket: Bucket) -> None:
            self._pad_all(bucket)
            self.backend.prepare_replay(self.batches[bucket])

        runs = {
            bucket: functools.partial(self._forward, self.batches[bucket])
            for bucket in sorted(self.buckets, key=lambda b: b.num_tokens, reverse=True)
        }
        self.capture_runs(runs, "buckets", prepare)
        self.graphs = {bucket: Captured(*pair) for bucket, pair in self.graphs.items()}

    def summary(self) -> dict:
        """What /get_server_info reports: the buckets, whether captured, capture time and
        graph memory."""
        decode = [b.requests for b in self.buckets if b.tokens == 1]
        verify = sorted({b.tokens for b in self.buckets if b.tokens > 1})
        return self.summary_with(
            decode_batch_sizes=decode, verify_tree_sizes=verify, buckets=len(self.buckets)
        )

    # ---- a step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self, batch: ForwardBatch, bucket: Bucket
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """`batch` (whose slots the table holds) in `bucket`: (final hidden states, captured
        layer inputs, float32 logits) of its real rows, request after request."""
        static = self.batches[bucket]
        rows = self._load(batch, bucket)
        if self.plan_copied is not None:
            # an attention plan (FlashInfer's) refills host buffers that the replay before this
            # one copies from: wait for that copy (at once unless a step was launched ahead,
            # DecodePipeline, and then for little more than the step before it), then mark ours
            self.plan_copied.synchronize()
            self.backend.prepare_replay(static)
            self.plan_copied.record()
        else:
            self.backend.prepare_replay(static)
        captured = self.graphs.get(bucket)
        if captured is None:
            hidden, layers, logits = self._forward(static)
        else:
            captured.graph.replay()
            hidden, layers, logits = captured.outputs
        if rows is None:  # the real rows come first
            t = batch.num_tokens
            return hidden[:t].clone(), [x[:t].clone() for x in layers], logits[:t]
        return (
            hidden.index_select(0, rows),
            [x.index_select(0, rows) for x in layers],
            logits.index_select(0, rows),
        )

    def _forward(
        self, batch: ForwardBatch
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        self.backend.init_forward_metadata(batch)
        hidden, captured = self.model(batch, self.backend)
        return hidden, captured, self.model.compute_logits(hidden)

    def _load(self, batch: ForwardBatch, bucket: Bucket) -> torch.Tensor | None:
        """Copy `batch` into the static buffers, padded to `bucket`; the host lists of the
        bucket's batch follow. Returns the real rows' places among the bucket's tokens, or
        None where they are its first `batch.num_tokens`. Nothing here waits for the device:
        what the host knows goes over in one copy."""
        inputs, static = self.inputs, self.batches[bucket]
        bs, n, real = bucket.requests, bucket.tokens, batch.batch_size
        sizes = batch.extend_lens
        verify = bucket.mode == ForwardMode.TARGET_VERIFY
        prefix = list(batch.prefix_lens) + [0] * (bs - real)
        static.prefix_lens = prefix
        dense = all(s == n for s in sizes)
        parts = {"seq_lens": [p + n for p in prefix]}
        parts["pad_rows"] = [self.req_to_token.dummy_row] * (bs - real)
        if not dense:  # each request's nodes from its first place of n
            parts["places"] = [b * n + j for b, s in enumerate(sizes) for j in range(s)]
            # The table places of a request's padding nodes point at the dummy slot: keys
            # masked out must still be finite (a masked weight of 0 times NaN is NaN).
            parts["unused_counts"] = [n - s for s in sizes]
            parts["unused_columns"] = [p + j for p, s in zip(prefix, sizes) for j in range(s, n)]
        if verify and not (dense and real == bs):
            parts["mask_places"] = tree_mask_places(sizes, n).tolist()
        staged = stage(parts, self.device)
        inputs.seq_lens[:bs].copy_(staged["seq_lens"])
        inputs.req_pool_indices[:real].copy_(batch.req_pool_indices)
        inputs.req_pool_indices[real:bs].copy_(staged["pad_rows"])
        t, total = batch.num_tokens, bucket.num_tokens
        pairs = (
            (inputs.input_ids, batch.input_ids),
            (inputs.positions, batch.positions),
            (inputs.out_cache_loc, batch.out_cache_loc),
        )
        rows = staged.get("places")
        if rows is None:
            for buf, values in pairs:
                buf[:t].copy_(values)
                buf[t:total].zero_()
        else:
            for buf, values in pairs:
                buf[:total].zero_()
                buf.index_copy_(0, rows, values)
            columns = staged["unused_columns"]
            table_rows = batch.req_pool_indices.repeat_interleave(
                staged["unused_counts"], output_size=len(parts["unused_columns"])
            )
            self.req_to_token.table[table_rows, columns] = 0
        if verify:
            mask = inputs.custom_mask[: bs * n * n]
            if "mask_places" not in staged:
                mask.copy_(batch.custom_mask)
            else:  # padding nodes see only themselves
                mask.view(bs, n, n).copy_(self._self_only[n])
                mask.index_copy_(0, staged["mask_places"], batch.custom_mask)
        return rows

    def _pad_all(self, bucket: Bucket) -> None:
        """Every request of the bucket padding (what a capture runs on)."""
        inputs, bs, n = self.inputs, bucket.requests, bucket.tokens
        self.batches[bucket].prefix_lens = [0] * bs
        for buf in (inputs.input_ids, inputs.positions, inputs.out_cache_loc):
            buf[: bucket.num_tokens].zero_()
        inputs.req_pool_indices[:bs].fill_(self.req_to_token.dummy_row)
        inputs.seq_lens[:bs].fill_(n)
        if bucket.mode == ForwardMode.TARGET_VERIFY:
            inputs.custom_mask[: bs * n * n].view(bs, n, n).copy_(self._self_only[n])
