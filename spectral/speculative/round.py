"""SpecRound: what each running request verifies in the next speculative round.

The one place a drafter plugs in: given the running batch, it gives every request its tree
size and, where the scheduler drafts (n-gram, grammar-forced text), the tree itself; the
worker's draft head expands the trees left to it. It learns from each verified round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spectral.core.forward import ForwardMode
from spectral.core.req import FinishReason, Req
from spectral.speculative.cost_model import CostModel
from spectral.speculative.lookahead import LookaheadDrafter, LookaheadState
from spectral.speculative.ngram import NgramDrafter, NgramState
from spectral.speculative.planner import Plan, PlanInput, TreePlanner, head_bucket, ngram_bucket
from spectral.speculative.settings import SpecSettings
from spectral.speculative.tree import merge_tree_nodes

if TYPE_CHECKING:
    from spectral.core.worker_io import WorkerResult


class SpecRound:
    def __init__(
        self,
        spec: SpecSettings,
        cost_model: CostModel | None,
        tokenizer: Any,
        max_context_len: int,
    ) -> None:
        """`tokenizer` encodes grammar-forced text; `cost_model` None (or fixed trees): every
        request verifies the settings' tree."""
        self.spec = spec
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        self.ngram: NgramDrafter | None = None
        if spec.uses_ngram:
            max_nodes, max_depth = spec.ngram_tree_shape
            self.ngram = NgramDrafter(
                max_nodes=max_nodes,
                max_depth=max_depth,
                min_ngram=spec.ngram_min_match,
                max_ngram=spec.ngram_max_match,
            )
        self.lookahead: LookaheadDrafter | None = None
        if spec.algorithm == "LOOKAHEAD":
            self.lookahead = LookaheadDrafter(*spec.lookahead)
        self.planner: TreePlanner | None = None
        if cost_model is not None and not spec.fixed_tree:
            self.planner = TreePlanner(
                cost_model, spec.num_steps, draft_model=spec.algorithm == "STANDALONE"
            )
        self._plan: Plan | None = None

    def plan(self, running: list[Req]) -> list[int] | None:
        """Each request's tree size (its root included), its n-gram and forced nodes set on
        `req.spec.draft_tokens`/`draft_parents`; None where a plain decode step is expected to do
        better (NGRAM alone: where it has nothing for anyone). A tree ends before its
        request's context does."""
        spec = self.spec
        inputs: list[PlanInput] = []
        for req in running:
            room = self.max_context_len - req.seq_len
            size, kind = spec.num_draft_tokens, head_bucket(req.spec.draft_top1)
            given: tuple[list[int], list[int]] | None = None  # the scheduler's tree, if any
            if self.ngram is not None:
                if req.spec.ngram is None:
                    req.spec.ngram = NgramState()
                tokens, parents = self.ngram.propose(req.all_ids, req.spec.ngram)
                if tokens or not spec.uses_draft_head:
                    size = (size if spec.hybrid_merge else 1) + len(tokens)
                    kind = ngram_bucket(req.spec.ngram.match_len)
                    given = tokens, parents
            if self.lookahead is not None:
                if req.spec.lookahead is None:
                    req.spec.lookahead = LookaheadState()
                state = req.spec.lookahead
                matched = bool(given and given[0])
                given = self.lookahead.propose(req.all_ids, state, *(given or ([], [])))
                size = 1 + len(given[0])
                if not matched:  # no n-gram match: counted apart with and without the pool's
                    kind = ngram_bucket(int(len(given[0]) > len(state.chain_nodes)))
            if given is not None:
                req.spec.draft_tokens, req.spec.draft_parents = (
                    given[0][: room - 1],
                    given[1][: room - 1],
                )
            req.spec.kind = kind
            inputs.append(
                PlanInput(kind, min(size, room), req.spec.accepted_tokens, req.spec.expected_drafts)
            )
        if self.planner is not None:
            self._plan = self.planner.plan(inputs)
            sizes = self._plan.nodes
        else:
            self._plan, sizes = None, [p.max_nodes for p in inputs]
        if (self._plan is not None and not self._plan.speculate) or (
            not spec.uses_draft_head and all(size == 1 for size in sizes)
        ):
            for req in running:
                req.spec.draft_tokens = req.spec.draft_parents = None
            return None
        for req, size in zip(running, sizes):
            if req.spec.draft_tokens is not None:
                req.spec.draft_tokens = req.spec.draft_tokens[: size - 1]
                req.spec.draft_parents = req.spec.draft_parents[: size - 1]
        return [size + self._add_forced_chain(req, size) for req, size in zip(running, sizes)]

    def _add_forced_chain(self, req: Req, size: int) -> int:
        """Give a request under a grammar the tokens of the text its grammar forces next (at
        most a tree's depth, within its context), as a chain from the root ahead of its planned
        tree's nodes (the worker's head tree joins them); returns the nodes added to `size`."""
        room = self.max_context_len - req.seq_len - size
        if req.grammar is None or not self.spec.grammar_drafts or room <= 0:
            return 0
        forced = req.grammar.forced_tokens(self._encode, min(self.spec.num_steps, room))
        if not forced:
            return 0
        given = req.spec.draft_tokens or []
        tokens, parents = merge_tree_nodes(
            forced, list(range(len(forced))), given, req.spec.draft_parents or []
        )
        req.spec.draft_tokens, req.spec.draft_parents = tokens, parents
        return len(tokens) - len(given)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def record_plan(self, sizes: list[int]) -> None:
        """The sizes the round ran with (after the pool's limits)."""
        if self.planner is not None:
            self.planner.record_plan(self._plan, sizes)

    def record_step(self, mode: ForwardMode, batch: int, seconds: float) -> None:
        """A decode or verify step's measured time (the planner compares it to its model)."""
        if self.planner is not None and mode != ForwardMode.EXTEND:
            self.planner.record_step(mode, batch, seconds)

    def observe(self, req: Req, result: WorkerResult, i: int, verified: int) -> None:
        """Learn acceptance by rank from request `req`'s (row `i`) verified round of
        `verified` non-root nodes."""
        req.spec.draft_tokens = req.spec.draft_parents = None
        if self.lookahead is not None and result.node_next_ids:
            grams = self.lookahead.observe(
                req.spec.lookahead, result.node_next_ids[i], verified, len(result.emitted_ids[i])
            )
            for gram in grams:  # the pool's n-grams join the n-gram drafter's corpus
                self.ngram.add_sequence(gram)
        if self.planner is None or not result.node_ranks:
            return
        ranks = result.node_ranks[i]
        path = [ranks[node] for node in result.accepted_nodes[i][1:]]
        req.spec.expected_drafts += self.planner.observe(
            req.spec.kind, verified, path, result.draft_probs[i]
        )

    def finished(self, req: Req, reason: FinishReason) -> None:
        """A finished request's text joins the n-gram drafter's corpus (aborted ones do not)."""
        if self.ngram is not None and reason.type != "abort":
            self.ngram.add_sequence(req.all_ids)

    def info(self) -> dict:
        return {
            "algorithm": self.spec.algorithm,
            "tree_policy": "fixed" if self.planner is None else "planned",
            "max_tree_nodes": self.spec.num_draft_tokens,
            **(self.planner.to_dict() if self.planner is not None else {}),
        }
