"""The EAGLE drafter on the worker side: the head's KV cache, the draft extend over verified
tokens, and the EAGLE-2 expansion of a draft tree.

KV slots: the head's one-layer pool is indexed by the target's slot ids through the same
req-to-token rows, so the drafter never allocates or frees a slot: a request's draft KV lives
and dies with its target KV. Tree nodes' draft KV is scratch: slots past the target's, a fixed
range per table row and tree level, rewritten by every `draft` call.

A draft's tree levels (`expand`) read nothing on the host: each level's k nodes a request
attend to the request's table row and their own ancestors' scratch slots (attention.rows), so
the whole expansion is one CUDA graph per batch size and depth (`use_graphs`).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from spectral.attention.registry import create_attention_backend
from spectral.attention.rows import rows_attention
from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.transfer import on_device
from spectral.layers.linear import weight_tensors
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool
from spectral.mem.weights import gather
from spectral.speculative.drafters.base import DrafterContext, file_stamp
from spectral.speculative.drafters.eagle_head import DraftHead, load_draft_head, resolve_draft_path
from spectral.speculative.drafters.expansion import TreeExpansion
from spectral.speculative.drafters.graphs import DraftGraphs, expand_through
from spectral.speculative.drafters.head_batches import (
    ExtendGraphs,
    Features,
    QueuedPositions,
    round_draft_batch,
    shifted_draft_batch,
)

# write_kv computes its queued positions once this many wait (64: 37 us a token at batch 16 on
# the default model; 256: 23 us, each computation's own cost spread).
FLUSH_TOKENS = 256


class EagleDrafter:
    """The head's KV and, per request row, what its last extend left: the top-k next tokens
    after the last verified token and the head's output there (the first tree step's feature).

    Position p's draft KV pairs the target feature at p with token p + 1; the scheduler keeps
    it valid across the radix cache by never reusing the last position of a matched prefix."""

    def __init__(
        self,
        head: DraftHead,
        num_slots: int,
        req_to_token: ReqToTokenPool,
        topk: int,
        num_steps: int,
        dtype: torch.dtype,
        device: str,
        attention_backend: str = "torch",
        kernels: ModuleType | None = None,
    ) -> None:
        """`attention_backend` names the backend of the head's extend (`auto`, `torch`,
        `triton`, `flashinfer`), resolved by the registry as the target's is, over the head's
        KV pool of `dtype`: a backend that refuses the dtype refuses here with the same error.
        `kernels`: spectral's CPU kernels (the tree levels' attention on a CPU), if loaded."""
        cfg = head.cfg
        gather(weight_tensors(head, buffers=True))  # off 4 KiB pages (spectral/mem/weights.py)
        self.head = head
        self.topk = topk
        self.num_steps = num_steps
        self.req_to_token = req_to_token
        self.kernels = kernels
        # every table row (the dummy row too) has (num_steps - 1) levels of topk scratch slots
        rows = req_to_token.max_requests + 1
        self.scratch_base = num_slots + 1
        scratch = rows * max(num_steps - 1, 0) * topk
        self.kv_pool = KVPool(num_slots + scratch, 1, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.scaling = cfg.head_dim**-0.5
        # its extends' attention through the CPU kernels where loaded, as the target's
        self.backend = create_attention_backend(
            attention_backend, self.kv_pool, req_to_token, self.scaling, device, kernels
        )
        self.topk_logprobs = torch.zeros((rows, topk), dtype=torch.float32, device=device)
        self.topk_ids = torch.zeros((rows, topk), dtype=torch.int64, device=device)
        self.last_hidden = torch.zeros((rows, cfg.hidden_size), dtype=dtype, device=device)
        # The inputs of the last position of rows whose top-k is stale (after `write_kv`;
        # written as its queue is flushed).
        self.stale_token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.stale_position = torch.zeros(rows, dtype=torch.int64, device=device)
        self.stale_slot = torch.zeros(rows, dtype=torch.int64, device=device)
        self.stale_feature = torch.zeros((rows, cfg.feature_size), dtype=dtype, device=device)
        self._queue = QueuedPositions()  # write_kv's
        # The rows whose top-k is stale and their last positions (the host decides with it).
        self._stale_rows: dict[int, int] = {}
        self.graphs: DraftGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None  # the round's extend, static

    needs_features = True

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose inputs the head needs (EAGLE-3); EAGLE-1 uses the final state."""
        return self.head.cfg.aux_layers if self.head.cfg.kind == "eagle3" else ()

    def observe_step(self, batch: ForwardBatch, next_ids: list[int], features: Features) -> None:
        """A prefill or plain decode step of the target (`next_ids`: each request's token
        after the batch): only the head's KV is queued (`write_kv`). After a prefill too: a
        request whose rounds are declined never pays for the head's layer over its prompt
        (its K and V alone are computed), and its first round runs the head at its last
        position first, as after plain steps."""
        if all(n == 1 for n in batch.extend_lens):  # each position pairs with its next token
            self.write_kv(batch, features, next_ids)
        else:
            self.write_kv(shifted_draft_batch(batch, next_ids), features)

    def observe_round(
        self,
        batch: ForwardBatch,
        prefix_lens: list[int],
        accepted_tokens: list[list[int]],
        emitted: list[list[int]],
        kept_slots: torch.Tensor,
        features: torch.Tensor,
        drafted: bool = True,
    ) -> None:
        """A verified round: the head extends over each request's accepted path (position p
        pairs the target's feature there with the token emitted after it). Where the head
        drafted none of the round's trees (n-gram, LOOKAHEAD) it may well not draft the next
        either: only its KV is queued, as after a plain step (`write_kv`)."""
        if drafted and self.extend_graphs is not None:
            self.flush()
            rows = batch.host_rows()
            if self.extend_graphs.run(rows, prefix_lens, emitted, kept_slots, features):
                self._fresh(rows)
                return
        round_batch = round_draft_batch(batch, prefix_lens, emitted, kept_slots)
        (self.extend if drafted else self.write_kv)(round_batch, features)

    def top1(self, rows: list[int]) -> list[float | None]:
        """The head's top-1 probability after each request row's last verified token, known
        before it drafts next (None where the row's top-k is stale)."""
        fresh = [row for row in rows if row not in self._stale_rows]
        if not fresh:  # after plain steps: nothing to read
            return [None] * len(rows)
        index = on_device(fresh, torch.int64, self.topk_logprobs.device)
        top1 = iter(self.topk_logprobs[index, 0].exp().tolist())
        return [None if row in self._stale_rows else next(top1) for row in rows]

    @torch.inference_mode()
    def extend(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        """Write the head's KV for the batch's new positions and keep, per request row, the
        top-k after its last position. `batch.input_ids` are the tokens one ahead of the
        positions (the token after each position); `features` [T, F] the target's."""
        self.flush()
        self.backend.init_forward_metadata(batch)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.backend.forward(q, k, v, 0, batch)

        hidden = self.head(batch.input_ids, features, batch.positions, attend)
        ends = on_device(batch.extend_lens, torch.int64, hidden.device).cumsum(0) - 1
        self._keep(hidden[ends], batch.req_pool_indices)
        self._fresh(batch.host_rows())

    def extend_rows(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        token_rows: torch.Tensor,
        last: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """`extend` in ExtendGraphs' layout, reading nothing on the host (the part a CUDA
        graph holds): each token a query row over its table row up to its position (its own
        key written first, to `slots`), the top-k kept after the tokens at `last` for `rows`."""
        attend = functools.partial(
            self._rows_attention, rows=token_rows, seq_lens=positions + 1, own=slots
        )
        hidden = self.head(tokens, features, positions, attend)
        self._keep(hidden[last], rows)

    def _keep(self, last: torch.Tensor, rows: torch.Tensor) -> None:
        """The head's output after each row's last position, and the top-k it gives."""
        logprobs = torch.log_softmax(self.head.logits(last), dim=-1)
        values, ids = logprobs.topk(self.topk, dim=-1)
        self.topk_logprobs[rows] = values
        self.topk_ids[rows] = self.head.to_target_ids(ids)
        self.last_hidden[rows] = last

    def _fresh(self, rows: list[int]) -> None:
        """`rows`' top-k is no longer stale (the host's mirror of `stale`)."""
        if self._stale_rows:
            for row in rows:
                self._stale_rows.pop(row, None)

    @torch.inference_mode()
    def write_kv(
        self, batch: ForwardBatch, features: Features, next_ids: list[int] | None = None
    ) -> None:
        """Only the head's KV for the batch's new positions (`extend`'s arguments, or a decode
        step's batch and the token after each position as the host has them), deferred until
        the head next reads its KV (`extend`, `draft`) or FLUSH_TOKENS wait: plain steps pay
        for one batched computation instead of many tiny ones, and touch no tensor. Each
        row's top-k is left stale; its next `draft` runs the full head there first."""
        rows = batch.host_rows()
        for row, start, n in zip(rows, batch.prefix_lens, batch.extend_lens):
            self._stale_rows[row] = start + n - 1  # the row's last position
        ids = batch.input_ids if next_ids is None else next_ids
        parts = (ids, features, batch.positions, batch.out_cache_loc, rows, batch.extend_lens)
        if self._queue.add(*parts) >= FLUSH_TOKENS:
            self.flush()

    @torch.inference_mode()
    def flush(self) -> None:
        """Compute and write the queued positions' KV (a slot queued twice takes its newest:
        `QueuedPositions.take`)."""
        taken = self._queue.take()
        if taken is None:
            return
        ids, features, positions, slots, rows, last, writes = taken
        self.stale_token[rows] = ids[last]
        self.stale_position[rows] = positions[last]
        self.stale_slot[rows] = slots[last]
        self.stale_feature[rows] = features[last]
        k, v = self.head.kv(ids, features, positions)
        self.kv_pool.write(0, writes, k, v)

    def _refresh(self, rows: torch.Tensor) -> None:
        """Run the full head at the last position of `rows` whose top-k is stale (the rows
        are read on the host only where some row is stale)."""
        if not self._stale_rows:
            return
        self.flush()  # the rows' last inputs may still be queued
        stale = [row for row in rows.tolist() if row in self._stale_rows]
        if not stale:
            return
        prefix_lens = [self._stale_rows[row] for row in stale]  # one new token at p: p before
        index = on_device(stale, torch.int64, rows.device)
        self.extend(
            ForwardBatch(
                mode=ForwardMode.DRAFT_EXTEND,
                input_ids=self.stale_token[index],
                positions=self.stale_position[index],
                out_cache_loc=self.stale_slot[index],
                req_pool_indices=index,
                prefix_lens=prefix_lens,
                extend_lens=[1] * len(stale),
                rows_host=stale,
            ),
            self.stale_feature[index],
        )

    @torch.inference_mode()
    def draft(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_steps: int | None = None,
        roots: torch.Tensor | None = None,
        root_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expand a tree below each request's last verified token (at position seq_len) for
        `num_steps` levels (default: the drafter's; the first levels do not depend on the
        depth), keeping the best `topk` nodes per level (EAGLE-2). Returns (cumulative log-prob,
        target token, parent candidate or -1 under the root), each [B, C] with
        C = k + (num_steps - 1) k², level by level, so parents come before their children.
        The roots need not be given: the head's KV already pairs the last position with its
        root."""
        self._refresh(rows)
        self.flush()
        steps = self.num_steps if num_steps is None else max(1, min(num_steps, self.num_steps))
        return expand_through(self.graphs, self.expand, rows, seq_lens, steps)

    def expand(
        self, rows: torch.Tensor, seq_lens: torch.Tensor, steps: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`draft`'s tree levels from the rows' last extends, reading nothing on the host:
        the part a CUDA graph holds. Level s's k nodes a request write their keys to the row's
        scratch slots of level s and attend to the row's verified prefix and their ancestors'
        scratch slots (themselves included)."""
        k = self.topk
        B = rows.shape[0]
        levels = TreeExpansion(self.topk_logprobs[rows], self.topk_ids[rows])
        if steps == 1:
            return levels.result()
        hidden = self.last_hidden[rows].repeat_interleave(k, dim=0)
        query_rows, query_lens = rows.repeat_interleave(k), seq_lens.repeat_interleave(k)
        ancestors = torch.zeros((B, k, 0), dtype=torch.int64, device=rows.device)
        for step in range(1, steps):
            own = self._scratch_slots(rows, step)
            ancestors = torch.cat((ancestors, own[:, :, None]), dim=-1)
            attend = functools.partial(
                self._rows_attention,
                rows=query_rows,
                seq_lens=query_lens,
                own=own.reshape(-1),
                ancestors=ancestors.reshape(B * k, step),
            )
            positions = query_lens + step - 1
            hidden = self.head(levels.frontier_tokens.reshape(-1), hidden, positions, attend)
            logprobs = torch.log_softmax(self.head.logits(hidden), dim=-1)
            levels.add_level(logprobs, self.head.to_target_ids)
            if step == steps - 1:
                break
            parent = levels.advance()[:, :, None]  # [B, k, 1]: each new node's parent
            hidden = hidden.view(B, k, -1).gather(1, parent.expand(B, k, hidden.shape[-1]))
            hidden = hidden.reshape(B * k, -1)
            ancestors = ancestors.gather(1, parent.expand(B, k, step))
        return levels.result()

    def _scratch_slots(self, rows: torch.Tensor, step: int) -> torch.Tensor:
        """[B, k] the scratch slots of tree level `step` (1-based) of each table row."""
        k, levels = self.topk, self.num_steps - 1
        first = self.scratch_base + (rows * levels + step - 1) * k
        return first[:, None] + torch.arange(k, device=rows.device)[None, :]

    def _rows_attention(
        self,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        own: torch.Tensor,
        ancestors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Query rows' attention: their keys and values written to their slots (`own`), each
        row over its table row's first `seq_lens` slots, then its `ancestors`' (a tree's)."""
        self.kv_pool.write(0, own, key, value)
        out = rows_attention(
            q,
            self.kv_pool.k[0],
            self.kv_pool.v[0],
            self.req_to_token.table,
            rows,
            seq_lens,
            self.scaling,
            tail=ancestors,
            kernels=self.kernels,
        )
        return out.reshape(q.shape[0], -1)

    def use_graphs(self, batch_sizes: list[int]) -> dict | None:
        """Draft batches of up to max(batch_sizes) requests through static buffers, one CUDA
        graph per batch size and depth where the drafter runs on a GPU (captured here);
        eagerly through the same buffers elsewhere."""
        device, dummy = self.req_to_token.table.device, self.req_to_token.dummy_row
        self.graphs = DraftGraphs.start(self.expand, dummy, batch_sizes, self.num_steps, device)
        self.extend_graphs = ExtendGraphs(
            self.extend_rows,
            dummy,
            batch_sizes,
            self.num_steps + 1,  # a round accepts at most its tree's depth and one more
            self.head.cfg.feature_size,
            self.last_hidden.dtype,
            device,
        )
        if device.type == "cuda":
            self.extend_graphs.capture()
        return self.graphs.summary() | {"extend": self.extend_graphs.summary()}


def build(ctx: DrafterContext) -> EagleDrafter:
    """EAGLE and EAGLE3: the head at --speculative-draft-model-path (its kind the algorithm's
    name), reading the target's embedding and LM head, its matmuls quantized as
    --speculative-draft-quantization says (on the integer path where the target's are)."""
    spec, target = ctx.spec, ctx.target
    cfg = target.config
    path = resolve_draft_path(spec.draft_model_path)
    head = load_draft_head(
        path,
        kind=spec.algorithm.lower(),
        target_hidden_size=cfg.hidden_size,
        target_vocab_size=cfg.vocab_size,
        target_num_layers=cfg.num_layers,
        max_positions=ctx.model.context_len + spec.num_steps + 1,
        dtype=target.dtype,
        device=target.device,
    )
    head.set_target(target.model.embed, target.model.compute_logits)
    head.set_cpu_kernels(target.model.kernels, spec.draft_quantization, target.integer_path)
    drafter = EagleDrafter(
        head,
        target.num_kv_slots,
        target.req_to_token,
        spec.topk,
        spec.num_steps,
        target.dtype,
        target.device,
        attention_backend=ctx.args.attention_backend,
        kernels=target.model.kernels,
    )
    drafter.cost_key = file_stamp(path)
    return drafter
