"""The tree planner and the cost model: acceptance by rank against a brute-force walk of every
subtree, plans against exhaustive search, trees shrinking as the batch grows under a fake cost
model, and per-request tree sizes in select_eagle_trees."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from spectral.args import ServerArgs
from spectral.core.forward import ForwardMode
from spectral.core.req import Req
from spectral.sampling_params import SamplingParams
from spectral.speculative.cost_model import (
    CALIBRATION_BOUNDS,
    BatchCalibration,
    Calibration,
    CostModel,
    interpolate,
)
from spectral.speculative.registry import get as get_algorithm
from spectral.speculative.settings import SpecSettings
from spectral.speculative.sources import plan_record
from spectral.speculative.sources import planner as planner_module
from spectral.speculative.sources import round as round_module
from spectral.speculative.sources.acceptance import (
    HEAD,
    NGRAM,
    RankStats,
    family,
    head_bucket,
    ngram_bucket,
)
from spectral.speculative.sources.plan_record import (
    HEAD_VALUE_DECAY,
    HEAD_VALUE_ROUNDS,
    PLAN_BACKOFF_AFTER,
    PLAN_BACKOFF_MOST,
    SHORTFALL_FLOOR,
    UNPLANNED_TIMED,
    HeadLedger,
    min_gain,
)
from spectral.speculative.sources.planner import (
    EXHAUSTIVE_CHOICES,
    PROBE_EVERY,
    PlanInput,
    TreePlanner,
)
from spectral.speculative.sources.round import SpecRound
from spectral.speculative.tree import select_eagle_trees

# A 2-core CPU's shape: a node costs ~1/8 of a one-token forward, the head ~1/3 of one.
STEEP = CostModel(
    verify=[(1, 12.0), (2, 13.5), (4, 16.0), (8, 22.0), (16, 34.0), (32, 60.0), (64, 115.0)],
    decode_one=11.0,
    draft=[(1, 0.5, 1.5), (4, 0.6, 2.0), (16, 1.0, 4.0)],
)


def random_tree(rng: random.Random, candidates: int = 12, n: int = 9):
    """An EAGLE-2 tree from random candidate scores: (tokens, parents, ranks) of its nodes."""
    scores, parents = [], []
    for c in range(candidates):
        parent = rng.randrange(-1, c) if c else -1
        base = scores[parent] if parent >= 0 else 0.0
        scores.append(base - rng.random() * 2)
        parents.append(parent)
    tokens = [rng.randrange(5) + 10 * c for c in range(candidates)]  # siblings differ
    trees = select_eagle_trees(
        torch.tensor([1]),
        torch.tensor([scores]),
        torch.tensor([tokens]),
        torch.tensor([parents]),
        n,
    )
    m = trees.num_nodes[0]
    return trees.tokens[0, :m].tolist(), trees.parents[0, :m].tolist(), trees.ranks[0, :m].tolist()


def greedy_walk(tokens, parents, allowed, choice) -> int:
    """Tokens a greedy verification emits over the nodes in `allowed`: follow the child whose
    token is the target's choice after the current node, plus the target's own next token."""
    node, emitted = 0, 1
    while True:
        nxt = [j for j in allowed if parents[j] == node and tokens[j] == choice[node]]
        if not nxt:
            return emitted
        node, emitted = nxt[0], emitted + 1


def test_rank_statistics_equal_a_walk_over_every_subtree() -> None:
    """After rounds that verify whole trees, 1 + the gains of the first r ranks is the mean
    number of tokens greedy verification would have emitted over the best r nodes alone."""
    rng = random.Random(0)
    stats = RankStats(HEAD)
    verified = 8
    totals = [0.0] * (verified + 1)
    rounds = 300
    for _ in range(rounds):
        tokens, parents, ranks = random_tree(rng, n=verified + 1)
        assert len(tokens) == verified + 1
        # The target agrees with the tree's likeliest children often, at random otherwise.
        choice = {}
        for node in range(len(tokens)):
            kids = sorted((ranks[j], tokens[j]) for j in range(len(tokens)) if parents[j] == node)
            choice[node] = kids[0][1] if kids and rng.random() < 0.6 else -1
            if kids and choice[node] == -1 and rng.random() < 0.5:
                choice[node] = rng.choice(kids)[1]
        full = list(range(1, len(tokens)))
        path, node = [], 0
        while True:
            nxt = [j for j in full if parents[j] == node and tokens[j] == choice[node]]
            if not nxt:
                break
            node = nxt[0]
            path.append(ranks[node])
        stats.observe(verified, path, None)
        for r in range(verified + 1):
            best = [j for j in full if ranks[j] < r]
            totals[r] += greedy_walk(tokens, parents, best, choice)
    hits = [h / s for h, s in zip(stats.hits, stats.seen)]
    for r in range(verified + 1):
        assert 1 + sum(hits[:r]) == pytest.approx(totals[r] / rounds)


@pytest.mark.parametrize("accepted", [0.5, 0.8])
def test_unverified_ranks_follow_the_heads_scores_scaled_by_their_record(accepted) -> None:
    """Rounds verify only rank 0, accepted at rate `accepted` while the head's scores promise
    0.8 for it and 0.4 for rank 1: over many rounds rank 0's gain is its record and rank 1's
    the score it was promised scaled by how rank 0 kept its promise (accepted / 0.8); the
    priors fade. Against the rates the rounds were drawn with, not the statistics' formulas."""
    stats = RankStats(HEAD)
    rng = random.Random(3)
    for _ in range(4000):
        stats.observe(1, [0] if rng.random() < accepted else [], [0.8, 0.4])
    gains = stats.gains(2)
    assert gains[0] == pytest.approx(accepted, abs=0.02)
    assert gains[1] == pytest.approx(0.4 * accepted / 0.8, abs=0.02)


def test_without_a_record_gains_decay_and_a_record_moves_them() -> None:
    """No rounds yet: each rank's gain a probability, lower for later ranks. Rounds whose
    ranks 0-2 are all accepted lift the first three towards 1."""
    ngram = RankStats(NGRAM)
    prior = ngram.gains(3)
    assert all(0 < g < 1 for g in prior)
    assert prior[0] > prior[1] > prior[2]
    for _ in range(500):
        ngram.observe(3, [0, 1, 2], None)
    assert all(g > 0.95 for g in ngram.gains(3))


def rate_of(planner: TreePlanner, reqs: list[PlanInput], sources, sizes) -> float:
    """Expected tokens per ms of one choice: request i on source `sources[i]` (an entry of
    its options) with `sizes[i]` nodes below the root (none: a plain step)."""
    cost = planner.cost
    B = len(reqs)
    if not any(sizes):
        return B / cost.plain_ms(B)  # declining pays the drafter's upkeep
    gains = [
        [min(1.0, g * planner.request_scale(r, kind)) for g in planner.stats_for(kind).gains(n - 1)]
        for r, (kind, n) in zip(reqs, sources)
    ]
    expected = B + sum(sum(g[:s]) for g, s in zip(gains, sizes))
    head = [s for (kind, _), s in zip(sources, sizes) if s and family(kind) == HEAD]
    levels = min(planner.max_levels, max(head, default=0))
    # a stale head runs at the request's last position first: one more level's forward
    stale = sum(1 for (kind, _), s in zip(sources, sizes) if s and kind == head_bucket(None))
    refresh = cost.draft_ms(stale, 2) - cost.draft_ms(stale, 1) if stale else 0.0
    # a draft model computes its KV over what each request it drafts for committed since
    catch_up = sum(
        r.catch_up_ms for r, (kind, _), s in zip(reqs, sources, sizes) if s and family(kind) == HEAD
    )
    draft = cost.draft_ms(len(head), levels) + refresh + catch_up
    return expected / (cost.verify_ms(B + sum(sizes)) + draft)


def brute_force(planner: TreePlanner, reqs: list[PlanInput]) -> float:
    """The best expected tokens per ms over every choice of each request's source and tree
    size, or a plain step's where no tree beats it by the planner's margin."""
    B = len(reqs)
    plain = rate_of(planner, reqs, [r.options[0] for r in reqs], [0] * B)
    best = 0.0
    for sources in itertools.product(*(r.options for r in reqs)):
        for sizes in itertools.product(*(range(n) for _, n in sources)):
            if any(sizes):
                best = max(best, rate_of(planner, reqs, sources, sizes))
    return best if best > min_gain(B) * plain else plain


def plan_rate(planner: TreePlanner, reqs: list[PlanInput], plan) -> float:
    """The rate of the plan's choice as `rate_of` puts it (not as the plan predicts it)."""
    sources = [r.options[c] for r, c in zip(reqs, plan.sources)]
    sizes = [n - 1 for n in plan.nodes] if plan.speculate else [0] * len(reqs)
    return rate_of(planner, reqs, sources, sizes)


def trained_planner(
    first: float = 0.7, decay: float = 0.75, cost: CostModel = STEEP
) -> TreePlanner:
    planner = TreePlanner(cost)
    rng = random.Random(1)
    for _ in range(400):
        path = []
        for r in range(12):  # a chain whose rank r is accepted with probability first * decay^r
            if rng.random() >= (first * decay**r) / (first * decay ** (r - 1) if r else 1):
                break
            path.append(r)
        planner.stats_for(HEAD).observe(12, path, [first * decay**r for r in range(16)])
        planner.stats_for(NGRAM).observe(6, path[:6], None)
    return planner


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_plans_are_the_best_of_every_choice_of_sizes(batch: int) -> None:
    planner = trained_planner()
    reqs = [
        PlanInput(HEAD, 5),
        PlanInput(NGRAM, 4, accepted=30, expected=10),
        PlanInput(HEAD, 3, accepted=2, expected=20),
    ][:batch]
    plan = planner.plan(reqs)
    assert plan_rate(planner, reqs, plan) == pytest.approx(brute_force(planner, reqs))
    assert all(1 <= n <= r.max_nodes for n, r in zip(plan.nodes, reqs))


def planner_with_sources(cost: CostModel = STEEP) -> TreePlanner:
    """A head whose confident rounds are accepted often and its unsure ones rarely; n-gram
    trees accepted often after long matches and rarely after short ones."""
    planner = TreePlanner(cost, 6)
    rng = random.Random(2)
    for kind, first, decay in (
        (head_bucket(0.9), 0.8, 0.8),
        (head_bucket(0.1), 0.2, 0.5),
        (ngram_bucket(4), 0.9, 0.9),
        (ngram_bucket(2), 0.15, 0.5),
    ):
        for _ in range(200):
            path = []
            for r in range(6):
                if rng.random() >= (first if r == 0 else decay):
                    break
                path.append(r)
            scores = [first * decay**r for r in range(6)] if family(kind) == HEAD else None
            planner.stats_for(kind).observe(6, path, scores)
    return planner


# Requests with an n-gram tree and the head beside it: which is better differs per request.
SOURCES = [
    PlanInput(ngram_bucket(2), 4, others=((head_bucket(0.9), 7),)),
    PlanInput(ngram_bucket(4), 7, others=((head_bucket(0.1), 7),)),
    PlanInput(ngram_bucket(2), 3, others=((head_bucket(0.1), 7),)),
]


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_each_requests_source_is_the_best_of_every_choice(batch: int) -> None:
    planner = planner_with_sources()
    reqs = SOURCES[:batch]
    plan = planner.plan(reqs)
    assert plan_rate(planner, reqs, plan) == pytest.approx(brute_force(planner, reqs))
    for req, n, source in zip(reqs, plan.nodes, plan.sources):
        assert 1 <= n <= req.options[source][1]
    assert plan.sources[0] == 1  # the confident head, not a short match
    if batch > 1:
        assert plan.sources[1] == 0  # a long match, not an unsure head


def test_a_stale_heads_tree_pays_for_the_heads_run_at_its_last_position() -> None:
    """A request whose head top-k is stale (its last positions went by in plain steps) gets
    the same statistics' tree at the cost of one more head forward: plans stay the best of
    every choice, a stale tree costs more than a fresh one, and where a head forward costs
    more than what the tree gains only the fresh request speculates."""
    planner = trained_planner()
    for bucket in (head_bucket(None), head_bucket(0.9)):
        planner.stats[bucket] = planner.stats[HEAD]
    stale, fresh = PlanInput(head_bucket(None), 4), PlanInput(head_bucket(0.9), 4)
    for reqs in ([stale], [stale, fresh], [fresh, stale, stale]):
        plan = planner.plan(reqs)
        assert plan_rate(planner, reqs, plan) == pytest.approx(brute_force(planner, reqs))
    assert planner.plan([stale]).predicted_ms > planner.plan([fresh]).predicted_ms
    dear = CostModel(verify=STEEP.verify, decode_one=11.0, draft=[(1, 0.5, 30.0)])
    planner = TreePlanner(dear)
    planner.stats = trained_planner().stats
    for bucket in (head_bucket(None), head_bucket(0.9)):
        planner.stats[bucket] = planner.stats[HEAD]
    assert planner.plan([fresh]).speculate and not planner.plan([stale]).speculate


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_a_draft_models_tree_pays_for_its_catch_up(batch: int) -> None:
    """A draft model computes its KV over what a request committed since it last drafted for
    it (its prompt, the plain steps since) before it drafts: plans with those catch-ups stay the
    best of every choice of sources and sizes; a request far behind takes its n-gram tree
    where one caught up takes the head's; and one whose catch-up costs more than its tree
    gains gets no round at all (a probe included), though the same request caught up does."""
    planner = planner_with_sources()
    for behind in (0.0, 8.0, 200.0):
        reqs = [dataclasses.replace(r, catch_up_ms=behind * (i + 1)) for i, r in enumerate(SOURCES)]
        plan = planner.plan(reqs[:batch])
        assert plan_rate(planner, reqs[:batch], plan) == pytest.approx(
            brute_force(planner, reqs[:batch])
        )
    caught_up, behind = SOURCES[0], dataclasses.replace(SOURCES[0], catch_up_ms=200.0)
    assert planner.plan([caught_up]).sources == [1]  # the confident head
    assert planner.plan([behind]).sources == [0]  # its n-gram tree instead
    head_only = PlanInput(head_bucket(0.9), 7)
    assert planner.plan([head_only]).speculate
    assert not planner.plan([dataclasses.replace(head_only, catch_up_ms=200.0)]).speculate
    assert not planner._best_plan_at(
        [dataclasses.replace(head_only, catch_up_ms=200.0)], 1.0
    ).speculate


def test_a_draft_models_requests_are_charged_what_it_has_not_computed() -> None:
    """STANDALONE's SpecRound charges each request's head tree the cost model's catch-up for
    every token since the draft last drafted for it (a new request: all of it), and a round
    whose tree the draft gives brings the request level again; EAGLE3's heads, whose upkeep
    runs each step, are charged none."""
    cost = dataclasses.replace(STEEP, catch_up=0.05)
    spec = SpecSettings.from_args(
        ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="draft")
    )
    spec_round = SpecRound(spec, cost, None, 4096)
    req = Req("r", list(range(3, 43)), SamplingParams())
    req.kv_slots = list(range(40))
    assert spec_round._plan_input(req, None, "").catch_up_ms == pytest.approx(0.05 * 40)
    observe_chains(spec_round.planner.stats_for(head_bucket(None)), 0.95, 6, random.Random(5))
    sizes = spec_round.plan([req])
    assert sizes is not None and sizes[0] > 1 and req.spec.draft_tokens is None
    # the round emits two tokens (the draft computed the first, the root's, the scheduler
    # keeps it), then three plain steps
    round_result = SimpleNamespace(node_next_ids=None, node_ranks=[], emitted_ids=[[7, 8]])
    spec_round.observe(req, round_result, 0, sizes[0] - 1)
    assert req.spec.draft_synced == 42
    req.kv_slots += [40, 41, 42, 43, 44]
    assert spec_round._plan_input(req, None, "").catch_up_ms == pytest.approx(0.05 * 3)
    eagle = SpecRound(
        SpecSettings.from_args(ServerArgs(speculative_algorithm="EAGLE3")), cost, None, 4096
    )
    assert eagle._plan_input(req, None, "").catch_up_ms == 0.0


# STEEP with a drafter whose upkeep costs a plain step 1-8% (EAGLE-3's, measured: ~0.3 ms of
# a ~12 ms step at batch 1, more as the batch grows).
IDLE = dataclasses.replace(STEEP, idle=[(1, 0.4), (4, 1.0), (16, 4.0)])


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_plans_with_the_drafters_idle_cost_are_the_best_of_every_choice(batch: int) -> None:
    """Declining a round pays the drafter's upkeep (`idle_ms`): with it in the cost model the
    plan is still the best of every choice of sources and sizes, stale heads included, and a
    round that only breaks even against the target's bare step runs once declining costs
    the upkeep too."""
    for reqs in (SOURCES[:batch], [PlanInput(head_bucket(None), 4)] * batch):
        planner = planner_with_sources(IDLE)
        planner.stats[head_bucket(None)] = planner.stats[head_bucket(0.9)]
        plan = planner.plan(reqs)
        assert plan_rate(planner, reqs, plan) == pytest.approx(brute_force(planner, reqs))
        assert plan.plain_ms == pytest.approx(IDLE.plain_ms(batch))
    weak = trained_planner(0.3, 0.5)
    reqs = [PlanInput(HEAD, 4)] * batch
    assert not weak.plan(reqs).speculate
    weak = trained_planner(0.3, 0.5, dataclasses.replace(STEEP, idle=[(1, 3.0)]))
    plan = weak.plan(reqs)
    assert plan.speculate and plan.predicted_gain > min_gain(batch)
    assert plan_rate(weak, reqs, plan) == pytest.approx(brute_force(weak, reqs))


def test_a_larger_batch_chooses_sources_near_the_best_combination() -> None:
    """Four requests (16 combinations of sources, more than the planner tries them all for):
    every request on the source its statistics favour, and the plan's rate within 2% of the
    best over every combination of sources and sizes (brute force)."""
    planner = planner_with_sources()
    reqs = [SOURCES[i % 2] for i in range(4)]
    assert 2 ** len(reqs) > EXHAUSTIVE_CHOICES
    plan = planner.plan(reqs)
    assert plan.speculate
    assert plan.sources == [1, 0] * 2
    assert plan_rate(planner, reqs, plan) >= 0.98 * brute_force(planner, reqs)


def test_trees_shrink_as_the_batch_grows_and_vanish_when_busy() -> None:
    planner = trained_planner()
    per_request = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        plan = planner.plan([PlanInput(HEAD, 16) for _ in range(batch)])
        per_request.append(sum(plan.nodes) / batch)
        assert plan.speculate == (plan.predicted_gain > min_gain(batch))
    assert per_request[0] > 2
    assert all(a >= b for a, b in zip(per_request, per_request[1:])), per_request
    assert per_request[-1] == 1  # a busy server decodes plainly


def test_a_request_that_is_accepted_more_gets_a_larger_tree() -> None:
    planner = trained_planner()
    plan = planner.plan(
        [PlanInput(HEAD, 16, accepted=5, expected=40), PlanInput(HEAD, 16, accepted=40, expected=5)]
    )
    assert plan.nodes[1] > plan.nodes[0]


def test_a_new_request_is_planned_on_what_earlier_requests_rounds_gave() -> None:
    """Rounds of a bucket the statistics know little of (its prior expects drafts) accepting
    none: a new request of the same family is planned at a lower acceptance, and smaller; the
    other family's requests are not moved."""
    planner = trained_planner()
    fresh = PlanInput(HEAD, 16)
    before = planner.plan([fresh])
    assert planner.request_scale(fresh, HEAD) == 1.0
    for _ in range(40):
        planner.observe(head_bucket(0.1), 6, [], [0.5] * 6)
    assert planner.request_scale(fresh, HEAD) < 0.7
    after = planner.plan([fresh])
    assert before.speculate and sum(after.nodes) < sum(before.nodes)
    assert after.expected_tokens < before.expected_tokens
    assert planner.request_scale(PlanInput(NGRAM, 4), NGRAM) == 1.0
    # a request's own record still moves it: accepted as expected, it scales up from there
    assert planner.request_scale(PlanInput(HEAD, 16, accepted=30, expected=30), HEAD) > 0.7


def test_declined_rounds_are_probed_where_they_break_even_never_where_they_lose(
    monkeypatch,
) -> None:
    """With a margin no plan meets, every PROBE_EVERY-th plan is a round the model expects to
    beat a plain step (at no margin); under a cost model where every node doubles a step, no
    round ever runs."""
    monkeypatch.setattr(plan_record, "MIN_GAIN", 100.0)
    planner = trained_planner()
    reqs = [PlanInput(HEAD, 8)]
    runs = [planner.plan(reqs) for _ in range(3 * PROBE_EVERY)]
    probed = [i for i, plan in enumerate(runs) if plan.speculate]
    assert probed == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]
    assert all(1.0 < runs[i].predicted_gain < 100.0 for i in probed)
    assert planner.to_dict()["rounds"]["probes"] == 3
    losing = CostModel(
        verify=[(1, 10.0), (2, 20.0), (64, 640.0)], decode_one=10.0, draft=[(1, 0.5, 1.5)]
    )
    monkeypatch.setattr(plan_record, "MIN_GAIN", 1.05)
    planner = TreePlanner(losing)
    planner.stats = trained_planner().stats
    assert not any(planner.plan(reqs).speculate for _ in range(3 * PROBE_EVERY))
    assert planner.to_dict()["rounds"]["probes"] == 0


def test_a_declined_plan_is_declined_again_without_planning_until_its_inputs_move(
    monkeypatch,
) -> None:
    monkeypatch.setattr(plan_record, "MIN_GAIN", 100.0)  # every plan declined
    planner = trained_planner()
    planned = []
    best_plan = planner.best_plan
    monkeypatch.setattr(planner, "best_plan", lambda reqs: planned.append(1) or best_plan(reqs))
    reqs = [PlanInput(HEAD, 8)]
    assert not any(planner.plan(reqs).speculate for _ in range(5))
    assert len(planned) == 1
    planner.observe(HEAD, 3, [0], [0.5] * 3)  # the statistics moved
    assert not planner.plan(reqs).speculate and len(planned) == 2
    assert not planner.plan([PlanInput(HEAD, 8, accepted=1, expected=1)]).speculate
    assert len(planned) == 3  # another request record
    plain = planner.calibration["plain"]
    plain.observe(1.05 * STEEP.decode_ms(1), STEEP.decode_ms(1))  # within the tolerance
    planner.plan([PlanInput(HEAD, 8, accepted=1, expected=1)])
    assert len(planned) == 3
    plain.observe(2.0 * STEEP.decode_ms(1), STEEP.decode_ms(1))  # plain steps slower
    planner.plan([PlanInput(HEAD, 8, accepted=1, expected=1)])
    assert len(planned) == 4


def test_a_declined_plan_is_kept_only_while_the_factors_move_less_than_the_margin() -> None:
    """The calibration's move a kept decline tolerates is no wider than the plan's margin: a
    move of ~3% plans again for one request of n-gram trees alone (margin 1.02), not where a
    drafter is kept in the worker (1.05)."""
    planned = {}
    for worker_drafter in (False, True):
        planner = TreePlanner(STEEP, worker_drafter=worker_drafter)
        for _ in range(200):  # nothing is ever accepted: every plan declines
            planner.observe(HEAD, 4, [], [0.01] * 4)
        count = []
        best_plan = planner.best_plan
        planner.best_plan = lambda reqs, best_plan=best_plan, count=count: (
            count.append(1) or best_plan(reqs)
        )
        reqs = [PlanInput(HEAD, 8)]
        assert not planner.plan(reqs).speculate
        plain = planner.calibration["plain"]
        plain.observe(1.2 * STEEP.decode_ms(1), STEEP.decode_ms(1))
        assert math.log(min_gain(1)) < math.log(plain.factor) < math.log(min_gain(1, True))
        assert not planner.plan(reqs).speculate
        planned[worker_drafter] = len(count)
    assert planned == {False: 2, True: 1}


def test_the_declined_plans_of_inputs_a_batch_moves_between_are_kept(monkeypatch) -> None:
    """A request moving between n-gram buckets (and tree sizes) is planned once per input."""
    monkeypatch.setattr(plan_record, "MIN_GAIN", 100.0)  # every plan declined
    planner = trained_planner()
    planned = []
    best_plan = planner.best_plan
    monkeypatch.setattr(planner, "best_plan", lambda reqs: planned.append(1) or best_plan(reqs))
    batches = [
        [PlanInput(HEAD, 8)],
        [PlanInput(NGRAM, 6)],
        [PlanInput(NGRAM, 3), PlanInput(HEAD, 8)],
    ]
    for _ in range(4):
        assert not any(planner.plan(reqs).speculate for reqs in batches)
    assert len(planned) == 3


def test_no_tree_pays_where_drafts_are_never_accepted() -> None:
    planner = TreePlanner(STEEP)
    for _ in range(200):
        planner.observe(HEAD, 4, [], [0.01] * 4)
    assert not planner.plan([PlanInput(HEAD, 8)]).speculate


def test_the_record_compares_predicted_and_measured_rounds() -> None:
    planner = trained_planner()
    plan = planner.plan([PlanInput(HEAD, 8)])
    planner.record_plan(plan, plan.nodes)
    planner.record_step(ForwardMode.TARGET_VERIFY, 1, plan.predicted_ms / 1000)
    planner.observe(HEAD, plan.nodes[0] - 1, [0, 1], [0.7, 0.5])
    info = planner.to_dict()
    assert info["rounds"]["rounds"] == 1
    assert info["rounds"]["predicted_gain"] == pytest.approx(plan.predicted_gain, abs=1e-3)
    measured = 3 / plan.predicted_ms / (1 / STEEP.decode_ms(1))
    assert info["rounds"]["measured_gain"] == pytest.approx(measured, abs=1e-3)
    assert info["last"]["tree_nodes"] == plan.nodes


def test_cost_model_interpolates_and_rejects_malformed_files() -> None:
    assert interpolate([(1, 10.0), (5, 18.0)], 3) == 14.0
    assert interpolate([(1, 10.0), (5, 18.0)], 9) == 26.0  # extended linearly
    assert STEEP.decode_ms(4) == pytest.approx(11.0 + 16.0 - 12.0)
    model = CostModel.from_dict(json.loads(json.dumps(STEEP.to_dict())))
    assert model == STEEP
    assert CostModel.from_dict(json.loads(json.dumps(IDLE.to_dict()))) == IDLE
    behind = dataclasses.replace(STEEP, catch_up=1.5)  # a draft model's, a token
    assert CostModel.from_dict(json.loads(json.dumps(behind.to_dict()))) == behind
    assert CostModel.from_dict({"verify": [[1, 1.0]], "decode_one": 1.0}).catch_up == 0.0
    assert IDLE.idle_ms(2) == pytest.approx(0.6) and IDLE.plain_ms(1) == pytest.approx(11.4)
    for bad in (
        {},
        {"verify": [[0, 1.0]], "decode_one": 1.0},
        {"verify": "x", "decode_one": 1},
        {"verify": [[1, 1.0]], "decode_one": 1.0, "idle": [[0, 1.0]]},
    ):
        with pytest.raises(ValueError, match="cost model"):
            CostModel.from_dict(bad)


def test_select_keeps_each_requests_own_number_of_best_candidates() -> None:
    torch.manual_seed(0)
    B, C = 3, 10
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]] * B)
    steps = torch.rand(B, C)
    scores = torch.zeros(B, C)
    for c in range(C):  # cumulative: a child scores below its parent
        p = parents[0, c]
        scores[:, c] = (scores[:, p] if p >= 0 else 0) - steps[:, c]
    tokens = torch.arange(C).expand(B, C) + 100
    sizes = [1, 4, 8]
    trees = select_eagle_trees(torch.tensor([1, 2, 3]), scores, tokens, parents, sizes)
    assert trees.num_draft_tokens == 8
    for b, n in enumerate(sizes):
        assert trees.num_nodes[b] == n
        best = scores[b].argsort(descending=True)[: n - 1]
        kept = trees.tokens[b, 1:n] - 100
        assert sorted(kept.tolist()) == sorted(best.tolist())
        # ranks order the kept nodes by score, 0 the best
        by_rank = [int(kept[j]) for j in trees.ranks[b, 1:n].argsort().tolist()]
        assert by_rank == best.tolist()
        assert trees.ranks[b, 0] == -1 and (trees.ranks[b, n:] == -1).all()


def test_a_draft_model_is_tried_where_a_heads_prior_would_not_be() -> None:
    """A draft LM whose levels cost 0.4 of a target step: with a head's prior (0.6 for the
    first draft, 0.85 decay) no tree pays; a draft model's prior (0.8, 0.9) tries one, and its
    record then takes over (never accepted: it stops)."""
    costly = CostModel(verify=STEEP.verify, decode_one=11.0, draft=[(1, 4.5, 4.5)])
    assert not TreePlanner(costly, 4).plan([PlanInput(HEAD, 5)]).speculate
    planner = TreePlanner(costly, 4, get_algorithm("STANDALONE").acceptance_prior)
    assert planner.plan([PlanInput(HEAD, 5)]).speculate
    for _ in range(40):
        planner.observe(HEAD, 4, [], [0.9, 0.8, 0.7, 0.6])
    assert not planner.plan([PlanInput(HEAD, 5)]).speculate


def test_one_request_needs_a_smaller_margin_unless_a_drafter_is_kept_in_the_worker() -> None:
    """A tree for one request expected to beat a plain step by 1.038: run at batch 1 (margin
    1.02) by a planner of scheduler drafts alone, declined where a drafter is kept in the worker
    (margin 1.05, as at every larger batch)."""
    costly = CostModel(verify=STEEP.verify, decode_one=11.0, draft=[(1, 3.8, 3.8)])
    assert min_gain(1) < 1.038 < min_gain(1, worker_drafter=True) == min_gain(2)
    plan = TreePlanner(costly, 4).plan([PlanInput(HEAD, 5)])
    assert plan.speculate and plan.predicted_gain == pytest.approx(1.038, abs=1e-3)
    assert not TreePlanner(costly, 4, worker_drafter=True).plan([PlanInput(HEAD, 5)]).speculate


def test_a_rank_drafted_once_does_not_set_its_gain_alone() -> None:
    """A draft model asked for one level most rounds: its second rank's one low score (0.43)
    weighs against the decay prior's pseudo-rounds instead of holding the rank at ~0.4, and a
    chain of two drafts is planned where the first is accepted 84% of the time."""
    costly = CostModel(verify=STEEP.verify, decode_one=11.0, draft=[(1, 2.0, 2.0)])
    planner = TreePlanner(costly, 4, get_algorithm("STANDALONE").acceptance_prior)
    for i in range(114):
        planner.observe(HEAD, 1, [0] if i % 6 else [], [0.84])
    planner.observe(HEAD, 2, [], [0.84, 0.434])
    gains = planner.stats_for(HEAD).gains(2)
    assert gains[1] > 0.55
    assert planner.plan([PlanInput(HEAD, 5)]).nodes[0] >= 3


def test_calibration_follows_measured_over_predicted_within_bounds() -> None:
    cal = Calibration()
    assert cal.factor == 1.0
    for _ in range(200):
        cal.observe(6.0, 10.0)
    assert cal.factor == pytest.approx(0.6, rel=1e-3)
    for _ in range(400):
        cal.observe(100.0, 10.0)  # 10x, bounded
    assert cal.factor == pytest.approx(CALIBRATION_BOUNDS[1], rel=1e-3)


def test_a_kinds_first_round_moves_its_factor_from_the_one_its_plan_used() -> None:
    """Plain steps timed at 1.5x the model: the first round is planned at 1.5x too, and when
    it takes 1.5x its prediction the rounds' factor stays there (it used to restart from 1,
    so that the next rounds were planned a third too cheap)."""
    planner = trained_planner()
    for _ in range(40):
        planner.record_step(ForwardMode.DECODE, 1, 1.5 * STEEP.plain_ms(1) / 1000)
    plan = planner.plan([PlanInput(NGRAM, 4)])
    assert plan.speculate and plan.predicted_ms == pytest.approx(1.5 * plan.verify_ms, rel=0.05)
    planner.record_plan(plan, plan.nodes)
    planner.record_step(ForwardMode.TARGET_VERIFY, 1, 1.5 * plan.verify_ms / 1000)
    assert planner.calibration["rounds"].factor == pytest.approx(1.5, rel=0.05)


def test_calibration_is_kept_per_batch_size_bucket() -> None:
    """Rounds of 2 requests at 1.2x the model and of 1 at 0.9x: each batch size is planned at
    its bucket's factor (one that has no step yet at the nearest bucket's), not at whichever
    size ran last."""
    cal = BatchCalibration()
    assert cal.factor_for(2) is None
    for _ in range(300):
        cal.observe(9.0, 10.0, 1)
        cal.observe(12.0, 10.0, 2)
    assert cal.factor_for(1) == pytest.approx(0.9, rel=1e-3)
    assert cal.factor_for(3) == pytest.approx(1.2, rel=1e-3)
    assert cal.factor_for(16) == pytest.approx(1.2, rel=1e-3)  # nearest: 2-3
    assert 0.9 < cal.factor < 1.2 and cal.count == 600
    planner = trained_planner()
    planner.calibration["rounds"] = cal
    for batch, factor in ((1, 0.9), (2, 1.2)):
        plan = planner.plan([PlanInput(NGRAM, 8)] * batch)
        assert plan.speculate
        assert plan.predicted_ms == pytest.approx(factor * plan.verify_ms, rel=1e-3)
    assert planner.to_dict()["calibration"]["rounds"]["by_batch"] == {"1-1": 0.9, "2-3": 1.2}


def test_rounds_slower_than_the_cost_model_turn_speculation_off() -> None:
    """A planner whose cost model says head rounds pay, while rounds take three times what
    it predicts and plain steps what it predicts: it stops planning rounds. Rounds without
    drafting (n-gram trees) are calibrated apart."""
    planner = trained_planner()
    plan = planner.plan([PlanInput(HEAD, 8)])
    assert plan.speculate and plan.draft_ms > 0
    for _ in range(60):
        plan = planner.plan([PlanInput(HEAD, 8)])
        if not plan.speculate:
            break
        planner.record_plan(plan, plan.nodes)
        planner.record_step(ForwardMode.TARGET_VERIFY, 1, 3 * plan.predicted_ms / 1000)
        planner.record_step(ForwardMode.DECODE, 1, STEEP.decode_ms(1) / 1000)
    assert not plan.speculate
    info = planner.to_dict()["calibration"]
    assert info["plain"]["factor"] == pytest.approx(1.0)
    assert info["drafted_rounds"]["factor"] > 1.3 and info["rounds"]["steps"] == 0

    ngram = TreePlanner(STEEP)
    plan = ngram.plan([PlanInput(NGRAM, 6)])
    assert plan.speculate and plan.draft_ms == 0
    ngram.record_plan(plan, plan.nodes)
    ngram.record_step(ForwardMode.TARGET_VERIFY, 1, 0.5 * plan.predicted_ms / 1000)
    assert ngram.calibration["rounds"].factor < 1.0
    assert ngram.calibration["drafted_rounds"].count == 0


def run_round(planner: TreePlanner, plan, share: float) -> None:
    """A round of `plan` that took the time it predicted and emitted `share` of the tokens it
    expected (the statistics left as they were: only the record sees it)."""
    planner.record_plan(plan, plan.nodes)
    planner.record.emitted_tokens += round(share * plan.expected_tokens)
    planner.record_step(ForwardMode.TARGET_VERIFY, len(plan.nodes), plan.predicted_ms / 1000)


def test_rounds_of_a_batch_short_of_their_predictions_raise_its_margin() -> None:
    """Rounds of 4 requests predicted at ~1.15x a plain step that give 0.9x: within a few the
    planner declines them (the margin grows by at most 1 / SHORTFALL_FLOOR), while a probe (no
    margin) still runs, one request's rounds are planned as before, and rounds that meet their
    predictions bring the margin back."""
    planner = trained_planner()
    reqs = [PlanInput(NGRAM, 4)] * 4
    plan = planner.plan(reqs)
    assert plan.speculate and 1.1 < plan.predicted_gain < plan_record.MIN_GAIN / SHORTFALL_FLOOR
    ran = 0
    while plan.speculate and ran < 50:
        run_round(planner, plan, 0.9 / plan.predicted_gain)
        ran += 1
        plan = planner.plan(reqs)
    assert not plan.speculate and 2 <= ran <= 12
    assert SHORTFALL_FLOOR <= planner.shortfall.factor(4) < 1.0
    assert planner.to_dict()["shortfall"] == {"4-7": round(planner.shortfall.factor(4), 3)}
    assert planner.calibration["rounds"].factor == pytest.approx(1.0)  # the time was as planned
    assert planner.shortfall.factor(1) == 1.0 and planner.plan(reqs[:1]).speculate
    runs = [planner.plan(reqs) for _ in range(PROBE_EVERY)]
    assert [p.speculate for p in runs] == [False] * (PROBE_EVERY - 1) + [True]  # the probe
    before = planner.shortfall.factor(4)
    for _ in range(30):
        run_round(planner, runs[-1], 1.0)
    assert planner.shortfall.factor(4) > before and planner.plan(reqs).speculate


VOCAB = 30  # few matches: trees often smaller than their lookups allow


def observe_chains(
    stats: RankStats, first: float, ranks: int, rng: random.Random, scores=None
) -> None:
    """100 rounds of chains `ranks` deep, each node accepted with probability `first`."""
    for _ in range(100):
        path = []
        for r in range(ranks):
            if rng.random() >= first:
                break
            path.append(r)
        stats.observe(ranks, path, scores)


def ngram_round(rng: random.Random) -> SpecRound:
    """NGRAM's SpecRound under STEEP, its buckets' statistics accepted often after long matches
    and rarely after short ones (some plans speculate, some decline), its index holding a few
    sequences of the same 12 tokens as the requests."""
    spec_round = SpecRound(
        SpecSettings.from_args(ServerArgs(speculative_algorithm="NGRAM")), STEEP, None, 4096
    )
    for length, first in ((1, 0.02), (2, 0.1), (3, 0.9), (4, 0.95)):
        observe_chains(spec_round.planner.stats_for(ngram_bucket(length)), first, 15, rng)
    for _ in range(4):
        spec_round.ngram.add_sequence([rng.randrange(VOCAB) for _ in range(40)])
    return spec_round


def built_plan(planner: TreePlanner, spec_round: SpecRound, reqs: list[Req]) -> list[int] | None:
    """The oracle: every request's n-gram tree built first, then planned at its size."""
    inputs = []
    for req in reqs:
        tokens, _ = spec_round.ngram.propose(req.all_ids)
        kind = ngram_bucket(spec_round.ngram.match(req.all_ids).longest)
        inputs.append(PlanInput(kind, 1 + len(tokens), req.spec.accepted_tokens))
    plan = planner.plan(inputs)
    return plan.nodes if plan.speculate and any(n > 1 for n in plan.nodes) else None


@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_trees_are_planned_on_their_lookups_and_built_where_verified(batch: int) -> None:
    """An n-gram tree is planned at the most nodes its lookups allow and built only where the
    plan verifies it, planned again where it came out smaller: a request alone gets the plan
    its built tree would have had (the planner copied before each step); in a batch every tree
    is within what was built, and a tree verified is the built tree's first nodes."""
    rng = random.Random(batch)
    spec_round = ngram_round(rng)
    reqs = [
        Req(f"r{i}", [rng.randrange(VOCAB) for _ in range(30)], SamplingParams())
        for i in range(batch)
    ]
    planned = 0
    for _ in range(150):
        oracle = built_plan(copy.deepcopy(spec_round.planner), spec_round, reqs)
        trees = [spec_round.ngram.propose(req.all_ids) for req in reqs]
        sizes = spec_round.plan(reqs)
        if batch == 1:
            assert sizes == oracle
        if sizes is not None:
            planned += 1
            for req, size, (tokens, parents) in zip(reqs, sizes, trees):
                assert size <= 1 + len(tokens)
                assert req.spec.draft_tokens == tokens[: size - 1]
                assert req.spec.draft_parents == parents[: size - 1]
            spec_round.record_plan(sizes)
        for req in reqs:  # the request goes on, now and then repeating its own past (its
            past = req.all_ids  # recent past: a match whose continuation is short)
            start = rng.randrange(len(past) - 8 if rng.random() < 0.5 else 0, len(past) - 3)
            repeat = rng.random() < 0.4
            req.output_ids += past[start : start + 3] if repeat else [rng.randrange(VOCAB)]
    record = spec_round.planner.record
    assert 10 < planned < 150 and record.replans > 0


@pytest.mark.parametrize("batch", [1, 4])
def test_no_lookup_is_made_where_no_match_it_could_find_would_be_verified(
    batch: int, monkeypatch
) -> None:
    """Where the planner declines every bucket each request's match can have grown to since
    its last lookup, no lookup is made: plans and trees equal those of a round that looks up
    every step, with far fewer lookups (and every request looked up again once the corpus
    grows)."""
    monkeypatch.setattr(planner_module, "PROBE_EVERY", 1 << 30)  # the same plans in both
    rounds = [ngram_round(random.Random(7)) for _ in range(2)]
    for spec_round in rounds:
        spec_round.backoff = None  # every step planned
    lookups = [0, 0]
    for i, spec_round in enumerate(rounds):
        match = spec_round.ngram.match

        def counted(context, state=None, i=i, match=match):
            lookups[i] += 1
            return match(context, state)

        spec_round.ngram.match = counted
    rounds[1]._declined_unlooked = lambda running: False  # looks up every step
    rng = random.Random(batch)
    prompts = [[rng.randrange(VOCAB) for _ in range(30)] for _ in range(batch)]
    reqs = [
        [Req(f"r{i}", list(p), SamplingParams()) for i, p in enumerate(prompts)] for _ in rounds
    ]
    for step in range(200):
        sizes = [spec_round.plan(batch_reqs) for spec_round, batch_reqs in zip(rounds, reqs)]
        assert sizes[0] == sizes[1]
        for skipping, looking in zip(*reqs):
            assert skipping.spec.draft_tokens == looking.spec.draft_tokens
            assert skipping.spec.draft_parents == looking.spec.draft_parents
        if step == 100:
            for spec_round in rounds:
                spec_round.ngram.add_sequence(prompts[0])
            before = lookups[0]
        if step == 101:  # the corpus grew: every request looked up
            assert lookups[0] == before + batch
        for i in range(batch):
            past = reqs[0][i].all_ids
            start = rng.randrange(len(past) - 3)
            new = past[start : start + 3] if rng.random() < 0.2 else [rng.randrange(VOCAB)]
            for batch_reqs in reqs:
                batch_reqs[i].output_ids += new
    skipped = 1 - lookups[0] / lookups[1]
    assert lookups[1] == 200 * batch and skipped > (0.2 if batch == 1 else 0.02), lookups


def hybrid_round(head_accepted: float) -> SpecRound:
    """EAGLE3's SpecRound with n-gram trees under STEEP: the confident head's drafts accepted
    at `head_accepted` a node, 4-token matches' at 0.97."""
    spec = SpecSettings.from_args(
        ServerArgs(speculative_algorithm="EAGLE3", speculative_hybrid_ngram=8)
    )
    spec_round = SpecRound(spec, STEEP, None, 4096)
    planner, rng = spec_round.planner, random.Random(3)
    observe_chains(planner.stats_for(head_bucket(0.9)), head_accepted, 6, rng, [0.9] * 6)
    observe_chains(planner.stats_for(ngram_bucket(4)), 0.97, 6, rng)
    return spec_round


def test_a_request_whose_plan_takes_the_heads_tree_is_left_to_the_head() -> None:
    """Beside the head (EAGLE3 with n-gram trees), a request with an n-gram match whose plan
    takes the head's tree gets no scheduler tree (None: the worker's head drafts it), not an
    empty one; one whose plan takes its n-gram tree gets that tree's first nodes."""
    spec_round = hybrid_round(head_accepted=0.95)
    observe_chains(spec_round.planner.stats_for(ngram_bucket(2)), 0.05, 6, random.Random(4))
    weak = Req("weak", [1, 2, 9, 1, 2, 7, 5, 1, 2], SamplingParams())  # a 2-token match
    strong = Req("strong", [3, 4, 5, 6, 8, 3, 4, 5, 6], SamplingParams())  # a 4-token match
    weak.spec.draft_top1 = strong.spec.draft_top1 = 0.9  # the head confident (fresh)
    sizes = spec_round.plan([weak])
    assert sizes is not None and sizes[0] > 1
    assert weak.spec.kind == head_bucket(0.9) and weak.spec.draft_tokens is None
    sizes = spec_round.plan([strong])
    assert sizes is not None and sizes[0] > 1
    assert strong.spec.kind == ngram_bucket(4)
    assert strong.spec.draft_tokens == spec_round.ngram.propose(strong.all_ids)[0][: sizes[0] - 1]


def test_a_head_given_no_tree_idles_then_wakes_for_one_plain_step(monkeypatch) -> None:
    """EAGLE3 with n-gram trees, the head never accepted and 4-token matches nearly always:
    after HEAD_IDLE_AFTER tokens without a head tree (a step of two requests counts two) the
    head idles (no head option planned: a request without a match verifies its root alone
    instead of being left to the head) while n-gram trees go on; after HEAD_WAKE_AFTER tokens
    idle one step plans nothing (the head's first step awake takes the states it drafts from),
    and the head is an option again."""
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 8)
    monkeypatch.setattr(round_module, "HEAD_WAKE_AFTER", 6)
    spec_round = hybrid_round(head_accepted=0.0)
    strong = Req("strong", [3, 4, 5, 6, 8, 3, 4, 5, 6], SamplingParams())  # a 4-token match
    bare = Req("bare", [11, 12, 13, 14, 15, 16, 17], SamplingParams())  # no match
    strong.spec.draft_top1 = bare.spec.draft_top1 = 0.9
    idle = []
    for _ in range(4):
        sizes = spec_round.plan([strong, bare])
        idle.append(spec_round.head_idle)
        assert sizes is not None and sizes[0] > 1 and bare.spec.draft_tokens is None
    assert idle == [False] * 3 + [True]  # idle from the fourth step's decode on
    for _ in range(2):  # three idle steps in all
        sizes = spec_round.plan([strong, bare])
        assert spec_round.head_idle and sizes is not None and sizes[1] == 1 and sizes[0] > 1
        assert strong.spec.kind == ngram_bucket(4) and bare.spec.draft_tokens == []
    assert spec_round.plan([strong, bare]) is None  # awake: its first step plain
    assert not spec_round.head_idle and strong.spec.draft_tokens is None
    sizes = spec_round.plan([strong, bare])
    assert sizes is not None and bare.spec.draft_tokens is None  # left to the head again


def test_a_head_that_never_pays_sleeps_longer_each_time(monkeypatch) -> None:
    """The head never accepted: each sleep without its having paid lasts twice the one before
    (HEAD_WAKE_AFTER, then 2x, 4x ...), up to HEAD_WAKE_MOST tokens, and each wake after one
    waits half as long for a tree (HEAD_IDLE_AFTER, then 1/2, down to 1/4); a head whose
    ledger is positive when it next goes to sleep sleeps HEAD_WAKE_AFTER again."""
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 8)
    monkeypatch.setattr(round_module, "HEAD_WAKE_AFTER", 6)
    monkeypatch.setattr(round_module, "HEAD_WAKE_MOST", 40)
    spec_round = hybrid_round(head_accepted=0.0)
    req = Req("r", [11, 12, 13, 14, 15, 16, 17], SamplingParams())  # no match: the head's
    req.spec.draft_top1 = 0.9

    awake: list[int] = []

    def sleep_tokens() -> int:
        awake.append(0)
        while not spec_round.head_idle:
            spec_round.plan([req])
            awake[-1] += 1
        slept = 0
        while spec_round.head_idle:
            spec_round.plan([req])
            slept += 1
        return slept

    assert [sleep_tokens() for _ in range(5)] == [6, 12, 24, 40, 40]
    assert awake == [8, 4, 2, 2, 2]
    ledger = spec_round.planner.head_ledger
    ledger.rounds, ledger.value = HEAD_VALUE_ROUNDS, 5.0  # paid while awake
    assert sleep_tokens() == 6


def test_a_head_given_trees_never_idles(monkeypatch) -> None:
    """A confident, accepted head gets a tree every step: it never idles; nor does a drafter
    that cannot (a draft model's tokens must be committed every step)."""
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 2)
    spec = SpecSettings.from_args(ServerArgs(speculative_algorithm="EAGLE3"))
    spec_round = SpecRound(spec, STEEP, None, 4096)
    observe_chains(
        spec_round.planner.stats_for(head_bucket(0.9)), 0.95, 6, random.Random(3), [0.9] * 6
    )
    req = Req("r", [3, 4, 5, 6, 8], SamplingParams())
    req.spec.draft_top1 = 0.9
    for _ in range(10):
        assert spec_round.plan([req]) is not None and not spec_round.head_idle
    assert get_algorithm("EAGLE3").idles and not get_algorithm("STANDALONE").idles


def test_a_head_alone_idling_plans_nothing(monkeypatch) -> None:
    """EAGLE3 without n-gram trees, its drafts never accepted: once idle, a step has no tree
    to plan, so the planner is not asked (until it wakes, HEAD_WAKE_AFTER idle steps on)."""
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 3)
    monkeypatch.setattr(round_module, "HEAD_WAKE_AFTER", 4)
    spec_round, req = head_alone_round(accepted=0.0)
    planner = spec_round.planner
    assert [spec_round.plan([req]) for _ in range(3)] == [None] * 3 and spec_round.head_idle
    asked, plan = [], planner.plan
    monkeypatch.setattr(planner, "plan", lambda reqs: asked.append(reqs) or plan(reqs))
    assert [spec_round.plan([req]) for _ in range(4)] == [None] * 4 and not asked
    assert not spec_round.head_idle  # the fourth woke it
    spec_round.plan([req])
    assert asked  # awake: planned again


def test_plain_steps_without_a_plan_are_timed_one_in_a_few(monkeypatch) -> None:
    """EAGLE3 alone: while its head is awake every plain step is timed (its upkeep is charged
    to the head's ledger); asleep, with nothing to plan, one plain step in UNPLANNED_TIMED is
    timed for the planner's calibration, and every step that a plan came before, or round."""
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 3)
    monkeypatch.setattr(round_module, "HEAD_WAKE_AFTER", 1000)
    spec_round, req = head_alone_round(accepted=0.0)
    planner = spec_round.planner
    timed: list[tuple[ForwardMode, bool]] = []
    record = planner.record_step
    monkeypatch.setattr(
        planner, "record_step", lambda m, b, s, awake: timed.append((m, awake)) or record(m, b, s)
    )

    def steps(n: int) -> list[tuple[ForwardMode, bool]]:
        """n plain steps, each planned first; those timed, and whether with the head awake."""
        timed.clear()
        for _ in range(n):
            assert spec_round.plan([req]) is None
            spec_round.record_step(ForwardMode.DECODE, 1, 0.005)
        return list(timed)

    assert steps(2) == [(ForwardMode.DECODE, True)] * 2 and not spec_round.head_idle
    steps(1)
    assert spec_round.head_idle
    assert steps(4 * UNPLANNED_TIMED) == [(ForwardMode.DECODE, False)] * 4
    assert planner.calibration["plain"].count == 3 + 4
    timed.clear()
    spec_round.record_step(ForwardMode.TARGET_VERIFY, 1, 0.005)  # a round: always timed
    spec_round.backoff.planned(False)  # a plan (declined) came before this step: timed
    spec_round.record_step(ForwardMode.DECODE, 1, 0.005)
    assert timed == [(ForwardMode.TARGET_VERIFY, False), (ForwardMode.DECODE, False)]
    assert spec_round.backoff.unplanned == 4 * UNPLANNED_TIMED


def test_a_head_sleeps_once_its_plans_decline_every_round_in_a_row(monkeypatch) -> None:
    """EAGLE3 alone, its drafts never accepted: the planner declines every step, so the head
    idles after HEAD_IDLE_DECLINES plans in a row, long before HEAD_IDLE_AFTER tokens (plain
    steps the backoff spaces between plans are not counted); awake again, it counts anew."""
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 1000)
    monkeypatch.setattr(round_module, "HEAD_WAKE_AFTER", 4)
    monkeypatch.setattr(round_module, "HEAD_IDLE_DECLINES", 5)
    spec_round, req = head_alone_round(accepted=0.0)
    steps = 0
    while not spec_round.head_idle:
        assert spec_round.plan([req]) is None
        steps += 1
    assert steps == 5
    for _ in range(4):  # asleep 4 tokens, the last waking it
        spec_round.plan([req])
    assert not spec_round.head_idle
    spec_round.backoff.skip = 2  # the backoff's plain steps between plans: not plans
    for _ in range(2 + 4):  # 2 skipped, 4 declined
        spec_round.plan([req])
    assert not spec_round.head_idle
    spec_round.plan([req])
    assert spec_round.head_idle


def head_alone_round(accepted: float) -> tuple[SpecRound, Req]:
    """EAGLE3 alone, its confident head's drafts accepted at `accepted` a node, and a request
    it drafts for."""
    alone = ServerArgs(speculative_algorithm="EAGLE3", speculative_hybrid_ngram=0)
    spec_round = SpecRound(SpecSettings.from_args(alone), STEEP, None, 4096)
    observe_chains(
        spec_round.planner.stats_for(head_bucket(0.9)), accepted, 6, random.Random(3), [0.9] * 6
    )
    req = Req("r", [3, 4, 5, 6, 8], SamplingParams())
    req.spec.draft_top1 = 0.9
    return spec_round, req


def paying_head_round(monkeypatch) -> tuple[SpecRound, Req]:
    """EAGLE3 alone, its head's statistics accepting nearly everything (the planner gives it a
    tree every step), and a request it drafts for."""
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 1 << 20)  # never for want of trees
    return head_alone_round(accepted=0.95)


def head_rounds(spec_round: SpecRound, req: Req, count: int, ms_of, accepted: int) -> None:
    """`count` steps: each planned, run as a round of `ms_of(plan)` ms whose `accepted` drafts
    the planner observes, and timed."""
    for _ in range(count):
        if spec_round.head_idle:
            return
        sizes = spec_round.plan([req])
        assert sizes is not None and sizes[0] > 1
        plan = spec_round._plan
        spec_round.record_plan(sizes)
        spec_round.planner.observe(req.spec.kind, sizes[0] - 1, list(range(accepted)), None)
        spec_round.record_step(ForwardMode.TARGET_VERIFY, 1, ms_of(plan) / 1000)


def test_a_head_whose_ledger_is_losing_sleeps(monkeypatch) -> None:
    """The planner keeps giving the head trees (its statistics say they pay), but its ledger
    (its rounds against the plain steps their tokens would have taken, less its upkeep) is
    negative after HEAD_VALUE_ROUNDS rounds: the next step puts it to sleep, though a tree was
    planned, and the ledger starts again from nothing."""
    spec_round, req = paying_head_round(monkeypatch)
    head_rounds(spec_round, req, 3, lambda plan: plan.predicted_ms, accepted=3)
    ledger = spec_round.planner.head_ledger
    assert not spec_round.head_idle and ledger.rounds == 3 and not ledger.losing
    for _ in range(HEAD_VALUE_ROUNDS):
        ledger.round(emitted=1, batch=1, plain_step_ms=10.0, ms=30.0)
    assert ledger.losing
    sizes = spec_round.plan([req])
    assert sizes is not None and sizes[0] > 1  # this step's tree stands
    assert spec_round.head_idle and ledger.rounds == 0 and ledger.value == 0.0


def test_a_head_whose_few_rounds_lost_sleeps_though_given_trees(monkeypatch) -> None:
    """Fewer rounds than the ledger judges on, but they cost more than they gave (its value
    below zero): the trees the planner goes on giving the head no longer keep it awake, and it
    sleeps after HEAD_IDLE_AFTER tokens as if it had been given none; back in the black, a tree
    keeps it awake again."""
    spec_round, req = paying_head_round(monkeypatch)
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 3)
    ledger = spec_round.planner.head_ledger
    ledger.round(emitted=1, batch=1, plain_step_ms=10.0, ms=30.0)
    assert ledger.value < 0 and not ledger.losing
    planned = []
    for _ in range(3):
        sizes = spec_round.plan([req])
        planned.append(sizes is not None and sizes[0] > 1)
    assert all(planned) and spec_round.head_idle
    spec_round, req = paying_head_round(monkeypatch)
    monkeypatch.setattr(round_module, "HEAD_IDLE_AFTER", 3)
    spec_round.planner.head_ledger.round(emitted=4, batch=1, plain_step_ms=10.0, ms=12.0)
    for _ in range(6):
        assert spec_round.plan([req]) is not None and not spec_round.head_idle


def test_a_head_whose_rounds_pay_stays_awake(monkeypatch) -> None:
    """The same head, its rounds as fast as planned and every draft accepted, plain steps
    between them charged its upkeep: its ledger stays positive and it never idles."""
    spec_round, req = paying_head_round(monkeypatch)
    for _ in range(5):
        head_rounds(spec_round, req, 4, lambda plan: plan.predicted_ms, accepted=3)
        spec_round.record_step(ForwardMode.DECODE, 1, STEEP.plain_ms(1) / 1000)
    ledger = spec_round.planner.head_ledger
    assert not spec_round.head_idle and ledger.rounds == 20 and ledger.value > 0
    before = ledger.value
    head_rounds(spec_round, req, 1, lambda plan: 20 * plan.predicted_ms, accepted=0)
    assert ledger.value < before  # a round slower than the plain steps it replaced


def test_the_head_ledger_weighs_rounds_against_plain_steps_and_upkeep() -> None:
    """A round adds the plain time of the tokens it emitted less its own; a plain step while
    the head is awake takes off its upkeep; entries decay; judged after HEAD_VALUE_ROUNDS."""
    ledger = HeadLedger()
    ledger.round(emitted=3, batch=1, plain_step_ms=10.0, ms=12.0)
    assert ledger.value == pytest.approx(18.0) and not ledger.losing
    ledger.plain_step(0.5)
    assert ledger.value == pytest.approx(18.0 * HEAD_VALUE_DECAY - 0.5)
    for _ in range(HEAD_VALUE_ROUNDS - 1):
        ledger.round(emitted=4, batch=2, plain_step_ms=10.0, ms=25.0)  # 2 steps' tokens in 2.5
    assert ledger.rounds == HEAD_VALUE_ROUNDS and ledger.losing


def test_plans_come_further_apart_after_many_declined_until_a_request_joins() -> None:
    """Under a cost model where every round loses, the first PLAN_BACKOFF_AFTER steps are
    planned, then plans come further and further apart, at most PLAN_BACKOFF_MOST plain steps;
    a request joining a batch is planned for at once, and after that plan declines the plans
    stay apart (the count of declines keeps the share the others saw), while a request replacing
    a batch of one is planned every step again; a batch with a request under a grammar is planned
    every step. No round runs."""
    losing = CostModel(
        verify=[(1, 10.0), (2, 20.0), (64, 640.0)], decode_one=10.0, draft=[(1, 0.5, 1.5)]
    )
    spec_round = ngram_round(random.Random(3))
    spec_round.planner = TreePlanner(losing)
    planned: list[int] = []
    make = spec_round._plan_sizes
    step = 0

    def counted(running, make=make):
        planned.append(step)
        return make(running)

    spec_round._plan_sizes = counted
    rng = random.Random(4)
    reqs = [Req("a", [rng.randrange(VOCAB) for _ in range(30)], SamplingParams())]

    def run(steps: int) -> None:
        nonlocal step
        for _ in range(steps):
            assert spec_round.plan(reqs) is None
            for req in reqs:
                req.output_ids.append(rng.randrange(VOCAB))
            step += 1

    run(700)
    gaps = [b - a for a, b in zip(planned, planned[1:])]
    assert planned[:PLAN_BACKOFF_AFTER] == list(range(PLAN_BACKOFF_AFTER))
    assert gaps == sorted(gaps) and max(gaps) == PLAN_BACKOFF_MOST + 1 == gaps[-1]
    reqs.append(Req("b", [rng.randrange(VOCAB) for _ in range(30)], SamplingParams()))
    joined = step
    run(3 * (PLAN_BACKOFF_MOST + 1) + 1)
    after = [s for s in planned if s >= joined]
    assert after[0] == joined  # at once
    gaps_after = [b - a for a, b in zip(after, after[1:])]
    assert len(gaps_after) >= 3 and all(1 < gap <= PLAN_BACKOFF_MOST + 1 for gap in gaps_after)
    reqs[:] = [Req("c", [rng.randrange(VOCAB) for _ in range(30)], SamplingParams())]
    replaced = step
    run(PLAN_BACKOFF_AFTER)
    assert [s for s in planned if s >= replaced] == list(range(replaced, step))
    reqs[0].grammar = object()  # declined before its forced text is asked for
    under_grammar = step
    run(10)
    assert planned[-10:] == list(range(under_grammar, step))
