"""STANDALONE speculation: a small LM with the target's tokenizer drafts EAGLE-2 trees from its
own top-k (SGLang's STANDALONE, vLLM's draft model, llama.cpp's --model-draft).

KV: the draft's pool is indexed by the target's slot ids, as the EAGLE head's is: position p
of a request keeps the draft's KV in the slot the target's req-to-token row gives p, so the
draft never allocates or frees a slot and its KV lives and dies with the target's. A slot's
draft KV depends only on the tokens up to its position, so a prefix the radix cache shares has
the same draft KV for every request that matches it. The draft catches up lazily: every token
the target commits (prefill, plain step, accepted path) is recorded with its slot and marked
not yet computed; when the draft next drafts for a request it runs one forward over the
request's positions from the first uncomputed one to its root (the last verified token,
written into the root's own slot). Plain steps the planner chooses over speculation thus cost
the draft nothing until it drafts again, and a matched prefix computed by an earlier request
is not computed again (docs/speculative.md, "Draft models").

Tree levels: each frontier node gets a scratch row of the draft's own req-to-token table (its
request's prefix, then its ancestors' scratch slots) and a scratch slot past the target's, so a
level is one plain decode step of B x k rows through the draft's attention backend. The
accepted tokens a level computed (a prefix of the accepted path, each a frontier node's) have
their draft KV copied from its scratch slot to the slot the target keeps them in, so the next
catch-up starts past them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.transfer import on_device
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool
from spectral.speculative.drafters.base import DrafterContext, file_stamp
from spectral.speculative.drafters.expansion import TreeExpansion
from spectral.speculative.drafters.token_map import load_token_map

# Requests drafted in one pass (the scratch rows are this times top-k).
DRAFT_CHUNK = 16


def scratch_sizes(topk: int, num_steps: int) -> tuple[int, int]:
    """(scratch rows, scratch slots) a drafter of this tree shape needs past the target's
    slot ids."""
    rows = DRAFT_CHUNK * topk
    return rows, rows * max(num_steps, 1)


class DraftLM(Protocol):
    """What the drafter needs of the draft LM's worker (a ModelWorker)."""

    config: Any
    device: str
    model: Any
    num_kv_slots: int
    kv_pool: KVPool
    req_to_token: ReqToTokenPool

    def forward_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]: ...


class DraftModelDrafter:
    capture_layers: tuple[int, ...] = ()
    needs_features = False

    def __init__(
        self,
        draft: DraftLM,
        target_table: ReqToTokenPool,
        num_target_slots: int,
        target_vocab_size: int,
        topk: int,
        num_steps: int,
        token_map: str | None = None,
    ) -> None:
        """`draft` is the draft LM's worker, its KV pool holding `num_target_slots` slots plus
        the scratch slots and its req-to-token table the scratch rows (`scratch_sizes`).
        `token_map` (a file of token ids: speculative.token_map) restricts what it drafts to
        those tokens: its LM head keeps only their rows."""
        rows, slots = scratch_sizes(topk, num_steps)
        # the target's slot ids run 0..num_target_slots (its pool's dummy slot among them)
        self.scratch_slot0 = num_target_slots + 1
        if (
            draft.req_to_token.max_requests < rows
            or draft.num_kv_slots < self.scratch_slot0 + slots
        ):
            raise ValueError("the draft worker has too few scratch rows or slots")
        self.lm = draft
        self.target_table = target_table
        self.topk = topk
        self.num_steps = num_steps
        self.vocab = min(target_vocab_size, draft.config.vocab_size)
        self.hot_ids: torch.Tensor | None = None
        if token_map is not None:
            hot_ids = load_token_map(token_map, self.vocab)  # ids both models have
            draft.model.restrict_logits(hot_ids)
            self.hot_ids = hot_ids.to(draft.device)
            self.vocab = hot_ids.numel()
        self.scratch = draft.req_to_token
        device = draft.device
        # Per target slot: the token the target committed there, and whether the draft's KV
        # there is computed for it.
        self.slot_token = torch.zeros(self.scratch_slot0, dtype=torch.int64, device=device)
        self.computed = torch.zeros(self.scratch_slot0, dtype=torch.bool, device=device)
        # The longest catch-up through the graph runner (`use_graphs`; 0: none is).
        self.catch_up_width = 0
        # Request row -> the root slot this round's draft wrote (computed when committed).
        self._rooted: dict[int, int] = {}
        # Request row -> what this round's draft computed for it (`_Drafted`).
        self._drafted: dict[int, _Drafted] = {}

    # ---- what the target commits ---------------------------------------------------------

    def commit(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The target keeps `tokens` at `slots`: the draft's KV there is to be computed."""
        slots = slots.to(self.slot_token.device)
        self.slot_token[slots] = tokens.to(self.slot_token.device)
        self.computed[slots] = False

    def observe_step(self, batch: ForwardBatch, next_ids: list[int], features: object) -> None:
        """A prefill or plain decode step: its input tokens are committed at their slots."""
        self.commit(batch.out_cache_loc, batch.input_ids)

    def observe_round(
        self,
        batch: ForwardBatch,
        prefix_lens: list[int],
        accepted_tokens: list[list[int]],
        emitted: list[list[int]],
        kept_slots: torch.Tensor,
        features: object,
        drafted: bool = True,
    ) -> None:
        """A verified round: each request's accepted path (root first) is committed at its
        kept slots; a root this round's draft wrote stays computed. `drafted` changes
        nothing: commits are queued either way."""
        offset = 0
        starts: list[int] = []
        copies: list[tuple[int, int]] = []  # (scratch slot, kept slot) of computed nodes
        for b, tokens in enumerate(accepted_tokens):
            row = int(batch.req_pool_indices[b])
            rooted = self._rooted.get(row) == int(kept_slots[offset])
            starts.extend(range(offset + (1 if rooted else 0), offset + len(tokens)))
            if rooted and row in self._drafted:
                path = self._drafted[row].scratch_slots(tokens[1:], self.scratch_slot0)
                for depth, scratch in enumerate(path, start=1):
                    copies.append((scratch, int(kept_slots[offset + depth])))
            offset += len(tokens)
        self._rooted.clear()
        self._drafted.clear()
        if starts:
            flat = torch.tensor([t for tokens in accepted_tokens for t in tokens])
            index = torch.tensor(starts)
            self.commit(kept_slots[index], flat[index])
        if copies:
            src, dst = torch.tensor(copies, device=self.computed.device).T
            self.lm.kv_pool.copy(src, dst)
            self.computed[dst] = True

    def flush(self) -> None:
        """Nothing to run now: committed tokens' KV is computed by the next draft that reads
        it (its catch-up, part of drafting's cost)."""

    def top1(self, rows: list[int]) -> list[float | None]:
        """The draft's confidence is known only once it drafts (it reads the root first)."""
        return [None] * len(rows)

    def use_graphs(self, batch_sizes: list[int]) -> dict | None:
        """A tree level is a decode step of the draft LM over k scratch rows a request: those
        steps go through the draft worker's graph runner (CUDA graphs on a GPU), at k times
        each batch size (a draft runs DRAFT_CHUNK requests at a time). A catch-up of at most
        num_steps + 1 positions a request (what a drafted round leaves) goes through the
        runner's verification buckets as chains (a causal mask); a longer one runs eagerly."""
        chunks = {min(bs, DRAFT_CHUNK) for bs in batch_sizes}
        levels = {self.topk * bs for bs in chunks}
        self.catch_up_width = self.num_steps + 1
        self.lm.use_graphs(sorted(levels | chunks), self.catch_up_width, max(chunks))
        return self.lm.graph_info()

    # ---- drafting ----------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_steps: int | None = None,
        roots: torch.Tensor | None = None,
        root_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expand a tree below each request's root (token `roots[i]` at position
        `seq_lens[i]`, slot `root_slots[i]`) for `num_steps` levels, keeping the best `topk`
        nodes a level; returns (cumulative log-prob, token, parent candidate or -1), each
        [B, C] with C = k + (levels - 1) k², level by level (EagleDrafter.draft's layout)."""
        if roots is None or root_slots is None:
            raise ValueError("a draft model drafts below given roots (their tokens and slots)")
        steps = self.num_steps if num_steps is None else max(1, min(num_steps, self.num_steps))
        self._rooted.clear()
        self._drafted.clear()
        parts = [
            self._draft_chunk(
                rows[i : i + DRAFT_CHUNK],
                seq_lens[i : i + DRAFT_CHUNK],
                roots[i : i + DRAFT_CHUNK],
                root_slots[i : i + DRAFT_CHUNK],
                steps,
            )
            for i in range(0, rows.shape[0], DRAFT_CHUNK)
        ]
        return tuple(torch.cat(column) for column in zip(*parts))  # type: ignore[return-value]

    def _draft_chunk(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        roots: torch.Tensor,
        root_slots: torch.Tensor,
        steps: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self.topk
        B = rows.shape[0]
        lens = seq_lens.tolist()
        scores, ids = self._catch_up(rows, lens, roots, root_slots).topk(k, dim=-1)
        levels = TreeExpansion(scores, self._target_ids(ids))
        if steps == 1:
            return levels.result()
        table = self.scratch.table
        group = torch.arange(B)[:, None] * k + torch.arange(k)[None, :]  # scratch rows [B, k]
        frontiers: list[torch.Tensor] = []  # each level's frontier candidates [B, k]
        for b, n in enumerate(lens):  # every row of a request starts as its prefix and root
            table[group[b, 1:], : n + 1] = table[group[b, 0], : n + 1]
        for step in range(1, steps):
            slots = self.scratch_slot0 + group * steps + step  # [B, k], this level's own
            for b, n in enumerate(lens):
                table[group[b], n + step] = slots[b]
            positions = torch.tensor(lens)[:, None] + step
            frontiers.append(levels.frontier_ids)
            batch = ForwardBatch(
                mode=ForwardMode.DECODE,
                input_ids=levels.frontier_tokens.reshape(-1),
                positions=positions.expand(B, k).reshape(-1).contiguous(),
                out_cache_loc=slots.reshape(-1),
                req_pool_indices=group.reshape(-1),
                prefix_lens=[n + step for n in lens for _ in range(k)],
                extend_lens=[1] * (B * k),
            )
            levels.add_level(self._logprobs(batch), self._target_ids)
            if step == steps - 1:
                break
            parent = levels.advance()  # [B, k]
            for b, n in enumerate(lens):  # each new frontier node takes its parent's path
                path = table[group[b][parent[b]], n + 1 : n + step + 1].clone()
                table[group[b], n + 1 : n + step + 1] = path
        result = levels.result()
        for b, row in enumerate(rows.tolist()):
            self._drafted[row] = _Drafted(b, steps, result[1][b], result[2][b], frontiers)
        return result

    def _catch_up(
        self, rows: torch.Tensor, lens: list[int], roots: torch.Tensor, root_slots: torch.Tensor
    ) -> torch.Tensor:
        """One forward over each request's positions from its first uncomputed one through
        its root (into scratch row b * k, the request's prefix copied there); the log-probs
        after each root [B, V]."""
        k = self.topk
        table = self.scratch.table
        ids: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        starts: list[int] = []
        for b, (row, n) in enumerate(zip(rows.tolist(), lens)):
            prefix = self.target_table.table[row, :n]
            missing = (~self.computed[prefix]).nonzero()
            start = int(missing[0]) if missing.numel() else n
            scratch_row = b * k
            table[scratch_row, :n] = prefix
            table[scratch_row, n] = root_slots[b]
            new_slots = torch.cat((prefix[start:], root_slots[b : b + 1]))
            ids.append(torch.cat((self.slot_token[prefix[start:]], roots[b : b + 1])))
            positions.append(torch.arange(start, n + 1))
            slots.append(new_slots)
            starts.append(start)
        out_slots = torch.cat(slots)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.cat(ids),
            positions=torch.cat(positions),
            out_cache_loc=out_slots,
            req_pool_indices=torch.arange(len(lens)) * k,
            prefix_lens=starts,
            extend_lens=[n + 1 - s for n, s in zip(lens, starts)],
        )
        logprobs = self._logprobs(batch)
        self.slot_token[root_slots] = roots
        self.computed[out_slots] = True
        self._rooted.update(zip(rows.tolist(), root_slots.tolist()))
        return logprobs

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's ids of columns of `_logprobs`."""
        return ids if self.hot_ids is None else self.hot_ids[ids]

    def _logprobs(self, batch: ForwardBatch) -> torch.Tensor:
        """The draft's log-probs after each request's last token, over the vocabulary it
        shares with the target (or its hot ids: columns map to tokens by `_target_ids`)."""
        if batch.mode == ForwardMode.DECODE:  # a tree level: through the graph runner if any
            _, _, logits = self.lm.forward_batch(batch)
        elif self.catch_up_width and max(batch.extend_lens) <= self.catch_up_width:
            _, _, logits = self.lm.forward_batch(as_chains(batch))  # every row's logits
            logits = logits[on_device(batch.extend_lens, torch.int64, logits.device).cumsum(0) - 1]
        else:
            hidden, _ = self.lm.forward_hidden(batch)
            ends = on_device(batch.extend_lens, torch.int64, hidden.device).cumsum(0) - 1
            logits = self.lm.model.compute_logits(hidden[ends])
        return torch.log_softmax(logits[:, : self.vocab].float(), dim=-1)


def as_chains(batch: ForwardBatch) -> ForwardBatch:
    """`batch` (an extend) as the verification of one chain a request: each new token sees
    the ones before it (a causal mask), every row's logits; a decode step where each request
    has one new token."""
    if max(batch.extend_lens) == 1:
        return dataclasses.replace(batch, mode=ForwardMode.DECODE)
    masks = [torch.ones(n, n, dtype=torch.bool).tril().reshape(-1) for n in batch.extend_lens]
    mask = torch.cat(masks).to(batch.input_ids.device)
    return dataclasses.replace(
        batch, mode=ForwardMode.TARGET_VERIFY, custom_mask=mask, logits_rows="all"
    )


@dataclass
class _Drafted:
    """What one draft computed for a request: its candidates (`tokens`, `parents`, in
    TreeExpansion.result's layout) and each level's frontier candidates [B, k], whose draft KV
    that level wrote: frontier node j of level d (row `b` of `frontiers[d - 1]`) in scratch
    row b * k + j, whose slot for level d is `scratch_slot0 + (b * k + j) * steps + d`."""

    b: int  # the request's place in its draft chunk
    steps: int
    tokens: torch.Tensor
    parents: torch.Tensor
    frontiers: list[torch.Tensor]

    def scratch_slots(self, path: list[int], scratch_slot0: int) -> list[int]:
        """The scratch slots holding the draft KV of the accepted `path`'s first tokens (below
        the root), as far as a level computed them."""
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        found: list[int] = []
        node = -1
        for depth, (token, frontier) in enumerate(zip(path, self.frontiers), start=1):
            nodes = frontier[self.b].tolist()
            k = len(nodes)
            j = next(
                (j for j, c in enumerate(nodes) if tokens[c] == token and parents[c] == node), None
            )
            if j is None:
                break
            node = nodes[j]
            found.append(scratch_slot0 + (self.b * k + j) * self.steps + depth)
        return found


def build(ctx: DrafterContext) -> DraftModelDrafter:
    """STANDALONE: the draft LM at --speculative-draft-model-path loaded as the target is (its
    layers quantized again by --speculative-draft-quantization where given), its KV pool
    indexed by the target's slots plus scratch for the tree levels, drafting from
    --speculative-token-map's ids where given. A draft whose tokenizer differs from the
    target's is refused, naming both (their model vocabularies may be padded to different
    sizes)."""
    spec, target, model = ctx.spec, ctx.target, ctx.model
    path = spec.draft_model_path
    rows, slots = scratch_sizes(spec.topk, spec.num_steps)
    worker, draft_vocab = ctx.load_lm(
        path,
        target.num_kv_slots + 1 + slots,
        rows,
        model.context_len + spec.num_steps + 1,
        spec.draft_quantization,
    )
    target_vocab = ctx.target_vocab()
    if target_vocab != draft_vocab:
        differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=str)[:3]
        raise ValueError(
            f"the draft model {path} has another tokenizer than the target "
            f"{ctx.args.model_path} ({len(draft_vocab)} against {len(target_vocab)} tokens; "
            f"e.g. {differ}): a draft model must share the target's tokenizer"
        )
    drafter = DraftModelDrafter(
        worker,
        target.req_to_token,
        target.num_kv_slots,
        model.vocab_size,
        spec.topk,
        spec.num_steps,
        spec.token_map,
    )
    drafter.cost_key = file_stamp(path)
    return drafter
