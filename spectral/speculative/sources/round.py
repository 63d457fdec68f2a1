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
from spectral.speculative.settings import SpecSettings
from spectral.speculative.sources.acceptance import (
    HEAD,
    family,
    head_bucket,
    ngram_bucket,
    ngram_reach_bucket,
    rest_bucket,
)
from spectral.speculative.sources.datastore import Datastore
from spectral.speculative.sources.lookahead import LookaheadDrafter, LookaheadState
from spectral.speculative.sources.ngram import NgramDrafter, NgramMatch, NgramState
from spectral.speculative.sources.plan_record import HEAD_VALUE_ROUNDS, PlanBackoff
from spectral.speculative.sources.planner import Plan, PlanInput, TreePlanner
from spectral.speculative.tree import merge_tree_nodes

if TYPE_CHECKING:
    from spectral.core.worker_io import WorkerResult

# The scheduler's draft of a request: its n-gram lookups (the tree not built yet), a tree, or
# none.
Draft = NgramMatch | tuple[list[int], list[int]] | None

# A worker drafter that may idle (`Algorithm.idles`: EAGLE heads) stops its upkeep of plain
# steps once the planner has given it no tree for HEAD_IDLE_AFTER tokens in a row (where its
# rounds stopped paying: the captured states and its KV cost a plain step 1-3%), or once its
# rounds have not paid for that upkeep (the planner's `head_ledger`), and takes it up
# again after HEAD_WAKE_AFTER tokens idle, drafting from the step after that (its top-k needs a
# step's states first); a planner that gives it trees again keeps it awake, while its ledger is
# not in the red (a few losing rounds a pass, too few for the ledger to judge, kept a head that
# never paid awake: code edits at batch 1, half the steps). Tokens, not steps:
# a step of B requests counts B, as the upkeep it costs grows with B (a step of 16 pays ~16
# times the KV a step of one does), so a large batch stops paying for an unused head as soon.
HEAD_IDLE_AFTER = 256
HEAD_WAKE_AFTER = 1024
# A head that goes to sleep again without having paid for itself while awake (its ledger's last
# HEAD_VALUE_ROUNDS rounds or more positive) sleeps twice as long as the time before, up to
# HEAD_WAKE_MOST tokens: where it never pays (chat at batch 16, the head alone on code) each
# wake costs its upkeep and the rounds its ledger judges it on, a few tenths of a percent of
# the time it sleeps; one that pays starts again from HEAD_WAKE_AFTER.
HEAD_WAKE_MOST = 8192
# Awake again after such a sleep, it waits half as long for a tree as the time before, down to
# HEAD_IDLE_AFTER >> HEAD_SHORTER_WAKES tokens: where it was never given one, its wakes were
# a fifth of a short run's steps, each with its upkeep (~1.6% of a step) and its planning.
HEAD_SHORTER_WAKES = 2
# It also idles as soon as HEAD_IDLE_DECLINES plans in a row have run no round of any source
# (the PlanBackoff's count, which a round or its waking restarts): nothing pays, and until
# something changes the planner declines again, so the wait in tokens only adds its upkeep
# (the head alone at batch 1 on HumanEval: an awake step 2.4-4.1% slower than a plain step).
HEAD_IDLE_DECLINES = 16


def _no_round(running: list[Req]) -> None:
    """A plain step for the batch: no request keeps a draft."""
    for req in running:
        req.spec.draft_tokens = req.spec.draft_parents = None


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
            datastore = None
            if spec.datastore is not None:
                datastore = Datastore(spec.datastore)
                datastore.check_tokenizer(tokenizer)
            self.ngram = NgramDrafter(
                max_nodes=max_nodes,
                max_depth=max_depth,
                min_ngram=spec.ngram_min_match,
                max_ngram=spec.ngram_max_match,
                datastore=datastore,
                ngrams=spec.ngram_matches,
            )
        self.lookahead: LookaheadDrafter | None = None
        if spec.uses_lookahead:
            self.lookahead = LookaheadDrafter(*spec.lookahead)
        self.planner: TreePlanner | None = None
        # ms a token the worker's drafter computes for a request before drafting it (draft models)
        self._catch_up = cost_model.catch_up if cost_model and spec.entry.catches_up else 0.0
        if cost_model is not None and not spec.fixed_tree:
            self.planner = TreePlanner(
                cost_model, spec.num_steps, spec.entry.acceptance_prior, spec.has_drafter
            )
        self._plan: Plan | None = None
        # The last plan was no round: only then is a plan without lookups tried first (after a
        # round the next is likely a round too, and the bound would not decline).
        self._declined = True
        # The worker's drafter idles (HEAD_IDLE_AFTER): its trees are not planned, and plain
        # steps and other sources' rounds ask it for no upkeep (`WorkerBatch.drafter_idle`).
        self.head_idle = False
        self._head_tokens = 0  # decoded since its last tree, or, idle, since it went idle
        self._unpaid_sleeps = 0  # sleeps in a row it went to without having paid
        self._may_idle = spec.has_drafter and spec.entry.idles and self.planner is not None
        # plans a step apart or more after many declined in a row (a planner's only)
        self.backoff = PlanBackoff() if self.planner is not None else None

    def flush(self) -> None:
        """Forget past requests (the server's cache flushed): the n-gram index's corpus. What
        the planner learnt of acceptance and costs stays."""
        if self.ngram is not None:
            self.ngram.clear()

    def plan(self, running: list[Req]) -> list[int] | None:
        """`_plan_step`, while counting the tokens toward the worker's drafter idling or waking
        (HEAD_IDLE_AFTER); the step it wakes plans nothing (its first step awake takes the
        states it drafts from)."""
        if not self._may_idle:
            return self._plan_step(running)
        if self.head_idle:
            self._head_tokens += len(running)
            sleep = HEAD_WAKE_AFTER << max(self._unpaid_sleeps - 1, 0)
            waking = self._head_tokens >= min(sleep, HEAD_WAKE_MOST)
            if waking:  # its trees planned every step again (the backoff counts anew)
                self.head_idle, self._head_tokens = False, 0
                self.backoff.restart()
            if waking or (self.ngram is None and self.lookahead is None):  # no tree to plan
                return _no_round(running)
            return self._plan_step(running)
        sizes = self._plan_step(running)
        ledger = self.planner.head_ledger
        # a tree keeps the head awake only while its rounds have not cost more than they gave
        head_tree = (
            sizes is not None
            and not ledger.in_the_red
            and any(size > 1 and family(req.spec.kind) == HEAD for req, size in zip(running, sizes))
        )
        self._head_tokens = 0 if head_tree else self._head_tokens + len(running)
        awake_for = HEAD_IDLE_AFTER >> min(self._unpaid_sleeps, HEAD_SHORTER_WAKES)
        nothing_pays = self.backoff.declined >= HEAD_IDLE_DECLINES
        if self._head_tokens >= awake_for or nothing_pays or ledger.losing:
            self.head_idle, self._head_tokens = True, 0
            paid = ledger.rounds >= HEAD_VALUE_ROUNDS and ledger.value > 0
            # capped: a long-running server must not shift by an ever larger count
            self._unpaid_sleeps = 0 if paid else min(self._unpaid_sleeps + 1, 16)
            ledger.reset()
        return sizes

    def _plan_step(self, running: list[Req]) -> list[int] | None:
        """`_plan_sizes`, on the steps the backoff plans (every step where a request is under
        a grammar: the text it forces drafts for nothing)."""
        backoff = self.backoff
        if (
            backoff is not None
            and not any(req.grammar is not None for req in running)
            and not backoff.plans([req.rid for req in running])
        ):
            return _no_round(running)
        sizes = self._plan_sizes(running)
        if backoff is not None:
            backoff.planned(sizes is not None)
        return sizes

    def _plan_sizes(self, running: list[Req]) -> list[int] | None:
        """Each request's tree size (its root included), its n-gram and forced nodes set on
        `req.spec.draft_tokens`/`draft_parents`; None where a plain decode step is expected to do
        better (NGRAM alone: where it has nothing for anyone). A tree ends before its
        request's context does. Where the scheduler has a tree for a request beside the
        worker's drafter, the planner chooses which of the two it verifies. An n-gram tree is
        planned at the most nodes its lookups allow and built only where the plan verifies
        it (planned again, rarely, where it came out smaller than planned)."""
        declined_before, self._declined = self._declined, True
        if declined_before and self._declined_unlooked(running):
            return _no_round(running)
        drafts = [self._scheduler_draft(req) for req in running]
        inputs = [
            self._plan_input(req, self._draft_nodes(draft), kind)
            for req, (draft, kind) in zip(running, drafts)
        ]
        if self.planner is not None:
            self._plan = self.planner.plan(inputs)
            if self._plan.speculate and self._build_trees(drafts, inputs, self._plan):
                self._plan = self.planner.replan(inputs)
            sizes, sources = self._plan.nodes, self._plan.sources
        else:
            self._build_trees(drafts, inputs, None)
            self._plan, sizes, sources = None, [p.max_nodes for p in inputs], None
        if (self._plan is not None and not self._plan.speculate) or (
            not self.spec.has_drafter and all(size == 1 for size in sizes)
        ):
            return _no_round(running)
        self._declined = False
        for b, (req, size, (tree, _), inp) in enumerate(zip(running, sizes, drafts, inputs)):
            source = sources[b] if sources else 0
            req.spec.kind = inp.options[source][0]
            if tree is not None and source == 0:
                if isinstance(tree, NgramMatch):  # not built: the plan verifies its root alone
                    tree = ([], [])
                req.spec.draft_tokens, req.spec.draft_parents = (
                    tree[0][: size - 1],
                    tree[1][: size - 1],
                )
            elif self.head_idle:  # nothing to verify but its root
                req.spec.draft_tokens, req.spec.draft_parents = [], []
            else:  # the worker's drafter gives this tree
                req.spec.draft_tokens = req.spec.draft_parents = None
                if req.spec.lookahead is not None:
                    req.spec.lookahead.chain_nodes = []
        return [size + self._add_forced_chain(req, size) for req, size in zip(running, sizes)]

    @property
    def _tree_base(self) -> int:
        """The nodes of a request's tree besides a scheduler's draft: the head's where they
        merge (its root alone while the drafter idles)."""
        merged = self.spec.hybrid_merge and not self.head_idle
        return self.spec.num_draft_tokens if merged else 1

    def _declined_unlooked(self, running: list[Req]) -> bool:
        """Whether the planner declines this step's round whatever the n-gram lookups would
        find, so that none is made: each request planned at the best of the buckets its match
        can have grown to since its last lookup (`NgramDrafter.reach`), at the most nodes."""
        if self.planner is None or self.ngram is None:
            return False
        # the shortest bucket with a tree (LOOKAHEAD's pool and window draft without a match)
        shortest = 0 if self.lookahead is not None else self.ngram.min_ngram
        most = self.ngram.max_nodes + (self.lookahead.most_nodes if self.lookahead else 0)
        inputs = []
        for req in running:
            state = req.spec.ngram
            reach = None if state is None else self.ngram.reach(req.num_ids, state)
            if reach is None:
                return False
            if self.lookahead is not None:  # its pool drafts without a match too (bucket 1)
                reach = max(reach, 1)
            if reach < shortest:  # no tree: the head's, or none
                nodes, kind = (None, "") if self.spec.has_drafter else (0, ngram_bucket(0))
            else:
                nodes, kind = most, ngram_reach_bucket(shortest, reach)
            inputs.append(self._plan_input(req, nodes, kind))
        return self.planner.declines(inputs)

    def _draft_nodes(self, draft: Draft) -> int | None:
        """The most nodes `draft` has (an n-gram lookup's before its tree is built)."""
        if draft is None:
            return None
        return self.ngram.most_nodes(draft) if isinstance(draft, NgramMatch) else len(draft[0])

    def _plan_input(self, req: Req, nodes: int | None, kind: str) -> PlanInput:
        """What the planner knows of `req`: its head tree's, or a tree of the scheduler's of
        at most `nodes` non-root nodes beside the head's where both could give it."""
        spec, record = self.spec, (req.spec.accepted_tokens, req.spec.expected_drafts)
        room = self.max_context_len - req.seq_len
        head = (head_bucket(req.spec.draft_top1), min(spec.num_draft_tokens, room))
        catch_up = self._catch_up * max(req.seq_len - req.spec.draft_synced, 0)
        if nodes is None and not self.head_idle:
            return PlanInput(*head, *record, catch_up_ms=catch_up)
        if nodes is None:  # the drafter idles: no tree
            nodes, kind = 0, ngram_bucket(0)
        size = self._tree_base + nodes
        beside = spec.has_drafter and not spec.hybrid_merge and not self.head_idle
        others = (head,) if beside else ()
        return PlanInput(kind, min(size, room), *record, others, catch_up)

    def _build_trees(self, drafts: list, inputs: list[PlanInput], plan: Plan | None) -> bool:
        """Build the n-gram trees `plan` verifies (every one without a plan), in place in
        `drafts`; where one has fewer nodes than planned, build them all and return True with
        `inputs` at their sizes (to plan again)."""
        short = False
        sources = (plan.sources if plan is not None else None) or [0] * len(drafts)
        for b in range(len(drafts)):
            if plan is not None and (plan.nodes[b] == 1 or sources[b] != 0):
                continue
            if self._build_tree(drafts, inputs, b) and plan is not None:
                short = short or plan.nodes[b] > inputs[b].max_nodes
        if short:
            for b in range(len(drafts)):
                self._build_tree(drafts, inputs, b)
        return short

    def _build_tree(self, drafts: list, inputs: list[PlanInput], b: int) -> bool:
        """Request b's n-gram tree built, if it was not: its input at the tree's size."""
        draft, kind = drafts[b]
        if not isinstance(draft, NgramMatch):
            return False
        tree = self.ngram.tree(draft)
        drafts[b] = (tree, kind)
        inputs[b].max_nodes = min(inputs[b].max_nodes, self._tree_base + len(tree[0]))
        return True

    def _scheduler_draft(self, req: Req) -> tuple[Draft, str]:
        """The draft the scheduler has for `req` (n-gram matches, then LOOKAHEAD's pool and
        window; with LOOKAHEAD the tree at once, else the n-gram lookups alone) and the
        statistics it counts in; None where it has none."""
        draft: Draft = None
        kind = ""
        if self.ngram is not None:
            if req.spec.ngram is None:
                req.spec.ngram = NgramState()
            state = req.spec.ngram
            found = self.ngram.match(req.all_ids, state)
            if found.has_continuations or not self.spec.has_drafter:
                # the datastore's (asked where no n-gram matched) count apart
                kind = (
                    rest_bucket(state.retrieved_len)
                    if state.retrieved_len
                    else ngram_bucket(state.match_len)
                )
                draft = found
        if self.lookahead is not None:
            if req.spec.lookahead is None:
                req.spec.lookahead = LookaheadState()
            state = req.spec.lookahead
            tree = self.ngram.tree(draft) if draft is not None else ([], [])
            matched = bool(tree[0])
            draft = self.lookahead.propose(req.all_ids, state, *tree)
            if not matched:  # no n-gram match: counted apart with and without the pool's
                kind = ngram_bucket(int(len(draft[0]) > len(state.chain_nodes)))
        return draft, kind

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
            awake = self._may_idle and not self.head_idle  # its upkeep charged every step
            if self.backoff.timed(mode == ForwardMode.DECODE) or awake:
                self.planner.record_step(mode, batch, seconds, awake)

    def observe(self, req: Req, result: WorkerResult, i: int, verified: int) -> None:
        """Learn acceptance by rank from request `req`'s (row `i`) verified round of
        `verified` non-root nodes."""
        req.spec.draft_tokens = req.spec.draft_parents = None
        if verified and self._catch_up and family(req.spec.kind) == HEAD:  # drafter level
            req.spec.draft_synced = req.seq_len + len(result.emitted_ids[i])
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
            "drafter_idle": self.head_idle,
            **(self.planner.to_dict() if self.planner is not None else {}),
        }
