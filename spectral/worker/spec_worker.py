"""SpeculativeWorker: the target worker plus a drafter, one speculative round per TARGET_VERIFY:
the trees are drafted (or given by the scheduler), verified in one target forward under the
tree mask, and the head extends over the accepted tokens (docs/speculative.md).

The scheduler owns the slots: it gives each request one slot per tree node and frees those of
the nodes the result does not list as accepted."""

from __future__ import annotations

import dataclasses

import torch

from spectral.core.forward import ForwardBatch, ForwardMode
from spectral.core.transfer import stage
from spectral.core.worker_io import RequestSampling, WorkerBatch, WorkerResult
from spectral.speculative.cost_model import CostModel
from spectral.speculative.drafters.base import Drafter
from spectral.speculative.sources.acceptance import probabilities
from spectral.speculative.tree import (
    DraftTrees,
    merge_tree_nodes,
    select_eagle_trees,
    tree_mask_places,
    trees_from_parents,
)
from spectral.speculative.verify import (
    packed_round,
    unpack_accepted,
)
from spectral.worker.grammar_follower import GrammarFollower
from spectral.worker.model_worker import ModelWorker
from spectral.worker.round_graphs import RoundGraphs
from spectral.worker.sampler import argmax_rows
from spectral.worker.spec_verify import round_result, verify_trees


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
        # Requests' rounds verified without the host (`_round_on_device`).
        self.rounds_on_device = 0
        # Such rounds' selection and walk through static buffers (the factory sets it where
        # the drafter's expansion has them too).
        self.round_graphs: RoundGraphs | None = None

    def grammar_ready(self, kind: str, text: str) -> bool:
        return self.grammars is None or self.grammars.ready(kind, text)

    def kv_pool_info(self) -> dict:
        info = self.target.kv_pool_info()
        draft_pool = getattr(self.drafter, "kv_pool", None)
        return info | ({"draft_bytes": draft_pool.nbytes} if draft_pool is not None else {})

    def graph_info(self) -> dict | None:
        """The target's graph runner's summary, with the drafter's under `draft` (None where
        the drafter has no static path)."""
        info = self.target.graph_info()
        if info is not None and self.drafter is not None:
            draft = self.draft_graphs
            if draft is not None and self.round_graphs is not None:
                draft = draft | {"round": self.round_graphs.summary()}
            info = info | {"draft": draft}
        return info

    def awake(self, wb: WorkerBatch) -> Drafter | None:
        """The drafter, where the batch asks it for work (None where there is none or it idles
        this step: nothing captured for it, nothing given to it, its top-1 unknown)."""
        return None if wb.drafter_idle else self.drafter

    def forward(self, wb: WorkerBatch) -> WorkerResult:
        if wb.mode == ForwardMode.TARGET_VERIFY:
            return self._verify_round(wb)
        if self.awake(wb) is None:
            return self.target.forward(wb)
        result, batch, hidden, captured = self.target.run(wb, self.drafter.capture_layers)
        next_ids = [
            nxt if nxt >= 0 else sampled
            for nxt, sampled in zip(
                wb.draft_next_ids or [-1] * batch.batch_size, result.next_token_ids
            )
        ]
        result.draft_top1 = self.observe_step(
            batch, wb.req_pool_indices, next_ids, hidden, captured
        )
        return result

    def observe_step(
        self,
        batch: ForwardBatch,
        rows: list[int],
        next_ids: list[int],
        hidden: torch.Tensor,
        captured: list[torch.Tensor],
    ) -> list[float | None]:
        """What keeping the drafter ready costs a prefill or plain decode step (the cost
        model's `idle` times it): the drafter only records the step (a head queues its keys
        and values, a draft model the tokens; a request's next draft catches up first, so
        plain steps cost it little). Returns its top-1 per request (`rows`: the batch's table
        rows, on the host), for the planner."""
        # captured layers' states as they are: a drafter that queues them joins them once
        features = (captured or hidden) if self.drafter.needs_features else None
        self.drafter.observe_step(batch, next_ids, features)
        return self.drafter.top1(rows)

    def _features(self, hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(captured, dim=-1) if captured else hidden

    # ---- one round ---------------------------------------------------------------------------

    @torch.inference_mode()
    def _verify_round(self, wb: WorkerBatch) -> WorkerResult:
        sizes = list(wb.extend_lens)
        offsets = [0]  # where each request's tree starts among the batch's nodes
        for n in sizes:
            offsets.append(offsets[-1] + n)
        if self._verifies_on_device(wb, sizes):
            verdict, batch, outputs, probs, ranks = self._round_on_device(wb, sizes, offsets)
            self.rounds_on_device += len(sizes)
        else:
            verdict, batch, outputs, probs, ranks = self._round(wb, sizes, offsets)
        hidden, captured, logits = outputs
        # The accepted nodes' slots join their requests' table rows (one copy of the places).
        width = self.target.req_to_token.max_context_len
        kept = stage(
            {
                "rows": [offsets[b] + j for b, acc in enumerate(verdict.accepted) for j in acc],
                "places": [
                    row * width + start + i
                    for row, start, acc in zip(
                        wb.req_pool_indices, wb.prefix_lens, verdict.accepted
                    )
                    for i in range(len(acc))
                ],
            },
            self.target.device,
        )
        kept_slots = batch.out_cache_loc[kept["rows"]]
        self.target.req_to_token.write_places(kept["places"], kept_slots)
        drafter = self.awake(wb)
        if drafter is not None:
            features = None
            if drafter.needs_features:
                features = self._features(hidden, captured)[kept["rows"]]
            drafter.observe_round(
                batch,
                list(wb.prefix_lens),
                # the accepted nodes' tokens: the root, then all but the last emitted
                [[wb.input_ids[b]] + out[:-1] for b, out in enumerate(verdict.emitted)],
                verdict.emitted,
                kept_slots,
                features,
                drafted=any(p is not None for p in probs),
            )
        result = round_result(verdict, logits, offsets, wb.sampling)
        result.node_ranks = ranks
        result.draft_probs = probs
        if drafter is not None:
            result.draft_top1 = drafter.top1(wb.req_pool_indices)
        return result

    def _round(self, wb: WorkerBatch, sizes: list[int], offsets: list[int]) -> tuple:
        """Trees (given, drafted, merged) built on the host, verified under any sampling,
        grammar or penalty: (verdict, the verify batch, its (hidden, captured, logits), the
        drafted requests' candidate probabilities, each tree's node ranks)."""
        target = self.target
        device = target.req_to_token.table.device
        seq_lens = torch.tensor(wb.prefix_lens, device=device)
        rows = torch.tensor(wb.req_pool_indices, device=device)
        trees, probs = self._trees(wb, rows, seq_lens, sizes, offsets)
        masks = self._grammar_masks(trees, sizes, wb.sampling)
        token_ids: list[int] = []
        positions: list[int] = []
        mask: list[bool] = []
        # the host's trees read through NumPy: torch's slices cost a round more on a CPU
        tokens, depths, tree_mask = (t.numpy() for t in (trees.tokens, trees.depths, trees.mask))
        for b, n in enumerate(sizes):
            token_ids.extend(tokens[b, :n].tolist())
            positions.extend((depths[b, :n] + wb.prefix_lens[b]).tolist())
            mask.extend(tree_mask[b, :n, :n].ravel().tolist())
        verify_wb = dataclasses.replace(
            wb, input_ids=token_ids, positions=positions, custom_mask=mask
        )
        batch = target.to_forward_batch(verify_wb)
        drafter = self.awake(wb)
        batch.capture_layers = drafter.capture_layers if drafter is not None else ()
        outputs = target.forward_batch(batch)  # logits stay on the device
        verdict = verify_trees(
            trees,
            outputs[2],
            sizes,
            wb.sampling,
            masks,
            self.target.model.kernels,
            self.report_node_choices,
        )
        ranks = [trees.ranks[b, :n].tolist() for b, n in enumerate(sizes)]
        return verdict, batch, outputs, probs, ranks

    def _verifies_on_device(self, wb: WorkerBatch, sizes: list[int]) -> bool:
        """Whether the round is the drafter's alone and the device can verify it without the
        host: every request drafted for (no given tree, more than its root), greedy, with
        nothing adjusting its logits (grammar, penalties, banned tokens) and no logprobs, and
        no node choices to report."""
        if self.drafter is None or self.report_node_choices or min(sizes) < 2:
            return False
        if wb.draft_tokens and any(tokens is not None for tokens in wb.draft_tokens):
            return False
        return all(
            s.params.is_greedy
            and s.params.grammar is None
            and not (s.params.has_penalties or s.banned_token_ids)
            and not (s.return_logprob or s.top_logprobs_num)
            for s in wb.sampling
        )

    def _round_on_device(self, wb: WorkerBatch, sizes: list[int], offsets: list[int]) -> tuple:
        """`_round` for rounds `_verifies_on_device` admits, reading nothing on the host
        before the round's result: the trees selected, laid out and verified where the
        drafter's candidates are, then one copy of the verdict, the node ranks and the
        candidates' scores."""
        target = self.target
        B, n = len(sizes), max(sizes)
        staged = stage(
            {
                "rows": wb.req_pool_indices,
                "seq_lens": wb.prefix_lens,
                "roots": wb.input_ids,
                "root_slots": [wb.out_cache_loc[start] for start in offsets[:-1]],
                "places": [b * n + j for b, size in enumerate(sizes) for j in range(size)],
                "mask_places": tree_mask_places(sizes, n).tolist(),
                "wanted": [size - 1 for size in sizes],
            },
            target.device,
        )
        scores, tokens, parents = self.drafter.draft(
            staged["rows"],
            staged["seq_lens"],
            num_steps=n - 1,
            roots=staged["roots"],
            root_slots=staged["root_slots"],
        )
        graphs = self.round_graphs
        candidates = (staged["roots"], scores, tokens, parents)
        trees = graphs.select(*candidates, staged["wanted"], sizes) if graphs else None
        if trees is None:
            trees = select_eagle_trees(*candidates, sizes, on_device=True)
        places = staged["places"]
        # the table writes and slots from the host; ids, positions and mask from the device
        batch = target.to_forward_batch(
            dataclasses.replace(wb, input_ids=[], positions=[], custom_mask=None)
        )
        batch.input_ids = trees.tokens.view(-1)[places]
        batch.positions = (trees.depths + staged["seq_lens"][:, None]).view(-1)[places]
        batch.custom_mask = trees.mask.view(-1)[staged["mask_places"]]
        batch.capture_layers = self.drafter.capture_layers
        outputs = target.forward_batch(batch)
        choices = torch.full((B * n,), -1, dtype=torch.int64, device=scores.device)
        choices[places] = argmax_rows(outputs[2], target.model.kernels)
        host = graphs.accept(choices.view(B, n)) if graphs else None
        if host is None:
            host = packed_round(trees, choices.view(B, n), scores).tolist()
        verdict = unpack_accepted([[int(x) for x in row[: 1 + 2 * n]] for row in host])
        ranks = [
            [int(x) for x in row[1 + 2 * n : 1 + 2 * n + size]] for row, size in zip(host, sizes)
        ]
        probs = [probabilities(row[1 + 3 * n :]) for row in host]
        return verdict, batch, outputs, probs, ranks

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
        awake = self.awake(wb) is not None
        merged = [
            awake and (self.merge_given_trees or s.params.grammar is not None) for s in wb.sampling
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
        if self.grammars is not None:  # the requests of no round since have finished
            self.grammars.retain({s.rid for s in sampling if s.params.grammar is not None})
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
