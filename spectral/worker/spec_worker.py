"""SpeculativeWorker: the target worker plus a drafter, one speculative round per TARGET_VERIFY:
the trees are drafted (or given by the scheduler), verified in one target forward under the
tree mask, and the head extends over the accepted tokens (docs/speculative.md).

The scheduler owns the slots: it gives each request one slot per tree node and frees those of
the nodes the result does not list as accepted."""

from __future__ import annotations

import dataclasses

import torch

from spectral.constrained import GrammarFollower, apply_bitmask
from spectral.core.forward import ForwardMode
from spectral.core.worker_io import RequestSampling, WorkerBatch, WorkerResult
from spectral.speculative.cost_model import CostModel
from spectral.speculative.drafters.base import Drafter
from spectral.speculative.sources.acceptance import probabilities
from spectral.speculative.tree import (
    DraftTrees,
    merge_tree_nodes,
    select_eagle_trees,
    trees_from_parents,
)
from spectral.speculative.verify import VerifyResult, verify_greedy, verify_sampling
from spectral.worker.model_worker import ModelWorker
from spectral.worker.sampler import apply_penalties, filtered_probs, request_step_seed


class SpeculativeWorker:
    def __init__(
        self,
        target: ModelWorker,
        drafter: Drafter | None,
        head_tree_size: int | None = None,
        merge_given_trees: bool = False,
        grammars: GrammarFollower | None = None,
        report_node_choices: bool = False,
    ) -> None:
        self.target = target
        self.drafter = drafter
        # Nodes (root included) of the head's trees; None: the batch's largest tree size.
        self.head_tree_size = head_tree_size
        # A request with a given (n-gram) tree verifies it together with the head's tree.
        self.merge_given_trees = merge_given_trees
        # Follows the requests under a grammar, to mask their trees node by node.
        self.grammars = grammars
        # Each verified round reports the target's choice after every node (LOOKAHEAD's
        # Jacobi iterations read them; no other drafter pays for them).
        self.report_node_choices = report_node_choices
        self.config = target.config
        self.num_kv_slots = target.num_kv_slots
        # What rounds cost here (the factory measures it, or reads it from the cache); the
        # scheduler's tree planner sizes trees by it. None: trees of fixed size.
        self.cost_model: CostModel | None = None
        # The drafter's static path's summary (Drafter.use_graphs), where the factory set one.
        self.draft_graphs: dict | None = None

    def graph_info(self) -> dict | None:
        """The target's graph runner's summary, with the drafter's under `draft` (None where
        the drafter has no static path)."""
        info = self.target.graph_info()
        if info is not None and self.drafter is not None:
            info = info | {"draft": self.draft_graphs}
        return info

    def forward(self, wb: WorkerBatch) -> WorkerResult:
        if wb.mode == ForwardMode.TARGET_VERIFY:
            return self._verify_round(wb)
        if self.drafter is None:
            return self.target.forward(wb)
        result, batch, hidden, captured = self.target.run(wb, self.drafter.capture_layers)
        next_ids = [
            nxt if nxt >= 0 else sampled
            for nxt, sampled in zip(
                wb.draft_next_ids or [-1] * batch.batch_size, result.next_token_ids
            )
        ]
        # A prefill or a plain decode step: the drafter only records it (a head queues its
        # keys and values, a draft model the tokens); a request's next draft catches up first,
        # so plain steps cost the drafter little.
        features = self._features(hidden, captured) if self.drafter.needs_features else None
        self.drafter.observe_step(batch, next_ids, features)
        result.draft_top1 = self.drafter.top1(wb.req_pool_indices)
        return result

    def _features(self, hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(captured, dim=-1) if captured else hidden

    # ---- one round ---------------------------------------------------------------------------

    @torch.inference_mode()
    def _verify_round(self, wb: WorkerBatch) -> WorkerResult:
        target = self.target
        sizes = list(wb.extend_lens)
        device = target.req_to_token.table.device
        seq_lens = torch.tensor(wb.prefix_lens, device=device)
        rows = torch.tensor(wb.req_pool_indices, device=device)
        offsets = [0]  # where each request's tree starts among the batch's nodes
        for n in sizes:
            offsets.append(offsets[-1] + n)
        trees, probs = self._trees(wb, rows, seq_lens, sizes, offsets)
        masks = self._grammar_masks(trees, sizes, wb.sampling)
        token_ids: list[int] = []
        positions: list[int] = []
        mask: list[bool] = []
        for b, n in enumerate(sizes):
            token_ids.extend(trees.tokens[b, :n].tolist())
            positions.extend((trees.depths[b, :n] + wb.prefix_lens[b]).tolist())
            mask.extend(trees.mask[b, :n, :n].reshape(-1).tolist())
        verify_wb = dataclasses.replace(
            wb, input_ids=token_ids, positions=positions, custom_mask=mask
        )
        batch = target.to_forward_batch(verify_wb)
        batch.capture_layers = self.drafter.capture_layers if self.drafter else ()
        hidden, captured, logits = target.forward_batch(batch)  # logits stay on the device
        verdict = self._verify(trees, logits, sizes, wb.sampling, masks)

        slots = batch.out_cache_loc
        kept_rows = [offsets[b] + j for b, acc in enumerate(verdict.accepted) for j in acc]
        kept_rows_t = torch.tensor(kept_rows)
        for b, acc in enumerate(verdict.accepted):
            start = wb.prefix_lens[b]
            kept = slots[torch.tensor(acc) + offsets[b]]
            target.req_to_token.table[wb.req_pool_indices[b], start : start + len(acc)] = kept
        if self.drafter is not None:
            features = None
            if self.drafter.needs_features:
                features = self._features(hidden, captured)[kept_rows_t.to(hidden.device)]
            self.drafter.observe_round(
                batch,
                list(wb.prefix_lens),
                [trees.tokens[b, acc].tolist() for b, acc in enumerate(verdict.accepted)],
                verdict.emitted,
                slots[kept_rows_t],
                features,
                drafted=any(p is not None for p in probs),
            )
        result = self._result(verdict, logits, offsets, wb.sampling)
        result.node_ranks = [trees.ranks[b, :n].tolist() for b, n in enumerate(sizes)]
        result.draft_probs = probs
        if self.drafter is not None:
            result.draft_top1 = self.drafter.top1(wb.req_pool_indices)
        return result

    def _trees(
        self,
        wb: WorkerBatch,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        sizes: list[int],
        offsets: list[int],
    ) -> tuple[DraftTrees, list[list[float] | None]]:
        """Each request's tree: the one the batch gives (n-gram), else the head's best
        `sizes[b]` nodes (a request of size 1 verifies its root alone and is not drafted for);
        with `merge_given_trees`, the union of both where one is given. Also, per request the
        head drafted for, its candidates' probabilities, best first."""
        n = max(sizes)
        B = len(sizes)
        node_tokens = list(wb.draft_tokens or [None] * B)
        node_parents = list(wb.draft_parents or [None] * B)
        given = [toks is not None for toks in node_tokens]
        # A request under a grammar is given the tokens its grammar forces: the head's tree
        # joins them.
        merged = [
            self.drafter is not None and (self.merge_given_trees or s.params.grammar is not None)
            for s in wb.sampling
        ]
        drafted = [b for b in range(B) if (merged[b] or not given[b]) and sizes[b] > 1]
        probs: list[list[float] | None] = [None] * B
        head_ranks: dict[int, torch.Tensor] = {}
        if drafted:
            if self.drafter is None:
                raise ValueError("a TARGET_VERIFY batch without draft trees needs a draft head")
            index = torch.tensor(drafted)
            head_n = [(self.head_tree_size or n) if given[b] else sizes[b] for b in drafted]
            # A tree of n nodes is at most n - 1 deep: deeper levels would not be kept. The
            # candidates come to the host (trees are built there), in one copy each.
            on_device = index.to(rows.device)
            drafts = self.drafter.draft(
                rows[on_device],
                seq_lens[on_device],
                num_steps=max(head_n) - 1,
                roots=torch.tensor(wb.input_ids, device=rows.device)[on_device],
                root_slots=torch.tensor(
                    [wb.out_cache_loc[offsets[b]] for b in drafted], device=rows.device
                ),
            )
            scores, tokens, parents = (t.cpu() for t in drafts)
            roots = torch.tensor(wb.input_ids)[index]
            trees = select_eagle_trees(roots, scores, tokens, parents, head_n)
            for i, b in enumerate(drafted):
                probs[b] = probabilities(scores[i].tolist())
            if len(drafted) == B and trees.num_draft_tokens == n and not any(given):
                return trees, probs
            for i, b in enumerate(drafted):
                toks = trees.tokens[i, 1 : trees.num_nodes[i]].tolist()
                pars = trees.parents[i, 1 : trees.num_nodes[i]].tolist()
                if given[b] and wb.sampling[b].params.grammar is not None:
                    # the grammar's forced tokens first: they are all but certain
                    toks, pars = merge_tree_nodes(node_tokens[b], node_parents[b], toks, pars)
                elif given[b]:
                    toks, pars = merge_tree_nodes(toks, pars, node_tokens[b], node_parents[b])
                else:
                    head_ranks[b] = trees.ranks[i, : trees.num_nodes[i]]
                node_tokens[b], node_parents[b] = toks[: sizes[b] - 1], pars[: sizes[b] - 1]
        for b in range(B):
            if node_tokens[b] is None:  # the head drafts nothing for a root alone
                node_tokens[b], node_parents[b] = [], []
        out = trees_from_parents(wb.input_ids, node_tokens, node_parents, n)
        for b, ranks in head_ranks.items():
            out.ranks[b, : ranks.numel()] = ranks
        return out, probs

    def _grammar_masks(
        self, trees: DraftTrees, sizes: list[int], sampling: list[RequestSampling]
    ) -> dict[int, torch.Tensor]:
        """Per request under a grammar (by batch index), the bitmask of each tree node: the
        tokens its grammar allows after the node's path."""
        masks: dict[int, torch.Tensor] = {}
        for b, s in enumerate(sampling):
            grammar = s.params.grammar
            if grammar is None:
                continue
            if self.grammars is None:
                raise ValueError("this worker was built without grammar support")
            matcher = self.grammars.follow(s.rid, grammar, s.params.stop_token_ids, s.output_ids)
            n = sizes[b]
            masks[b] = matcher.tree_bitmask(
                trees.tokens[b, :n], trees.next_token[b, :n], trees.next_sibling[b, :n]
            )
        return masks

    def _verify(
        self,
        trees: DraftTrees,
        logits: torch.Tensor,
        sizes: list[int],
        sampling: list[RequestSampling],
        masks: dict[int, torch.Tensor] | None = None,
    ) -> VerifyResult:
        """Accept a path per request: greedy requests by argmax, others by the lossless
        sampling rule, both on logits adjusted per node as plain decoding would adjust them
        (penalties, then the grammar's mask where `masks` has the request's)."""
        B, n = trees.tokens.shape
        vocab = logits.shape[-1]
        accepted: list[list[int]] = [[] for _ in range(B)]
        emitted: list[list[int]] = [[] for _ in range(B)]
        greedy_rows = [b for b, s in enumerate(sampling) if s.params.is_greedy]
        sampled_rows = [b for b, s in enumerate(sampling) if not s.params.is_greedy]
        adjusted: list[torch.Tensor] = []
        offset = 0
        for b, size in enumerate(sizes):
            raw = logits[offset : offset + size]
            block = raw
            node_sampling = _node_sampling(trees, b, size, sampling[b])
            if node_sampling is not None:
                block = apply_penalties(block, node_sampling)  # a copy where it changes any
            if masks and b in masks:
                # in place, on a copy: the logprobs read the raw logits
                block = block.clone() if block is raw else block
                block = apply_bitmask(block, masks[b], self.target.model.kernels)
            adjusted.append(block)
            offset += size
        # the target's choice after each node: greedy verification's, and what a round that
        # reports node choices reports for every request
        chosen_rows = range(B) if self.report_node_choices else greedy_rows
        choices = {b: adjusted[b].argmax(dim=-1) for b in chosen_rows}
        if greedy_rows:
            ids = torch.full((len(greedy_rows), n), -1, dtype=torch.int64, device=logits.device)
            for i, b in enumerate(greedy_rows):
                ids[i, : sizes[b]] = choices[b]
            part = verify_greedy(_select(trees, greedy_rows), ids)
            for i, b in enumerate(greedy_rows):
                accepted[b], emitted[b] = part.accepted[i], part.emitted[i]
        if sampled_rows:
            probs = torch.zeros((len(sampled_rows), n, vocab), device=logits.device)
            generators: list[torch.Generator | None] = []
            for i, b in enumerate(sampled_rows):
                s = sampling[b]
                probs[i, : sizes[b]] = filtered_probs(adjusted[b], [s] * sizes[b])
                probs[i, sizes[b] :, 0] = 1.0  # padding rows: never reached
                gen = None
                if s.params.seed is not None:
                    seed = request_step_seed(s.params.seed, len(s.output_ids))
                    gen = torch.Generator().manual_seed(seed)
                generators.append(gen)
            # The walk runs on the host: one copy of the filtered distributions.
            probs = probs.cpu()
            part = verify_sampling(_select(trees, sampled_rows), probs, generators=generators)
            for i, b in enumerate(sampled_rows):
                accepted[b], emitted[b] = part.accepted[i], part.emitted[i]
        node_next = [choices[b].tolist() for b in range(B)] if self.report_node_choices else []
        return VerifyResult(accepted, emitted, node_next)

    def _result(
        self,
        verdict: VerifyResult,
        logits: torch.Tensor,
        offsets: list[int],
        sampling: list[RequestSampling],
    ) -> WorkerResult:
        emitted_logprobs: list[list[float] | None] = []
        emitted_top: list[list[list[tuple[float, int]]] | None] = []
        for b, s in enumerate(sampling):
            if not (s.return_logprob or s.top_logprobs_num):
                emitted_logprobs.append(None)
                emitted_top.append(None)
                continue
            rows = torch.tensor(verdict.accepted[b]) + offsets[b]
            logprobs = torch.log_softmax(logits[rows], dim=-1)
            chosen = torch.tensor(verdict.emitted[b], device=logits.device)
            emitted_logprobs.append(logprobs.gather(1, chosen[:, None])[:, 0].tolist())
            if s.top_logprobs_num:
                values, ids = logprobs.topk(s.top_logprobs_num, dim=-1)
                emitted_top.append([list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())])
            else:
                emitted_top.append(None)
        return WorkerResult(
            next_token_ids=[e[0] for e in verdict.emitted],
            logprobs=[lp[0] if lp else None for lp in emitted_logprobs],
            top_logprobs=[t[0] if t else None for t in emitted_top],
            accepted_nodes=verdict.accepted,
            emitted_ids=verdict.emitted,
            emitted_logprobs=emitted_logprobs,
            emitted_top_logprobs=emitted_top,
            node_next_ids=verdict.node_next,
        )


def _select(trees: DraftTrees, rows: list[int]) -> DraftTrees:
    """The trees of `rows` only."""
    index = torch.tensor(rows)
    return DraftTrees(
        tokens=trees.tokens[index],
        parents=trees.parents[index],
        depths=trees.depths[index],
        mask=trees.mask[index],
        next_token=trees.next_token[index],
        next_sibling=trees.next_sibling[index],
        num_nodes=[trees.num_nodes[r] for r in rows],
    )


def _node_sampling(
    trees: DraftTrees, b: int, size: int, s: RequestSampling
) -> list[RequestSampling] | None:
    """Per tree node, the sampling state plain decoding would have there: the output so far
    extended by the node's path (penalties count it), and banned tokens while the output is
    shorter than min_new_tokens. None when nothing depends on the node."""
    if not (s.params.has_penalties or s.banned_token_ids):
        return None
    parents = trees.parents[b].tolist()
    tokens = trees.tokens[b].tolist()
    out: list[RequestSampling] = []
    for j in range(size):
        path: list[int] = []
        node = j
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        output = s.output_ids + path[::-1]
        banned = s.banned_token_ids if len(output) < s.params.min_new_tokens else []
        out.append(dataclasses.replace(s, output_ids=output, banned_token_ids=banned))
    return out
