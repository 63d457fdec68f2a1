"""Speculative decoding end to end in the scheduler: greedy output identical token for token to
plain decoding (float32) under every scheduling path, with nothing leaked."""

from __future__ import annotations

import atexit
import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from spectral.args import ServerArgs
from spectral.core.forward import ForwardMode
from spectral.core.req import Req
from spectral.models.config import ModelConfig
from spectral.models.resolved import resolve_model
from spectral.sampling_params import SamplingParams
from spectral.scheduler.config import SchedulerConfig
from spectral.scheduler.scheduler import Scheduler
from spectral.speculative.drafters.eagle_head import DraftHead, DraftHeadConfig
from spectral.speculative.drafters.head_batches import joined, shifted_draft_batch
from spectral.speculative.sources import round as round_module
from spectral.speculative.sources.planner import PROBE_EVERY
from spectral.speculative.tree import select_eagle_trees
from spectral.worker.factory import create_worker
from tests.conftest import scheduler_leaks


def make_random_head(path: Path, target_dir: str, kind: str, seed: int = 0) -> str:
    """A randomly initialised EAGLE / EAGLE-3 head for the target at `target_dir`."""
    target = ModelConfig.from_pretrained(target_dir)
    torch.manual_seed(seed)
    L = target.num_layers
    cfg = DraftHeadConfig(
        kind=kind,
        hidden_size=target.hidden_size,
        intermediate_size=2 * target.hidden_size,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        vocab_size=target.vocab_size,
        draft_vocab_size=512 if kind == "eagle3" else target.vocab_size,
        target_hidden_size=target.hidden_size,
        fc_bias=kind == "eagle",
        aux_layers=(0, L // 2, L) if kind == "eagle3" else (),
    )
    head = DraftHead(cfg, max_positions=64)
    if kind == "eagle3":
        used = torch.randperm(target.vocab_size)[:512].sort().values
        head.d2t.copy_(used - torch.arange(512))
        head.t2d.zero_()
        head.t2d[used] = True
    head.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory: pytest.TempPathFactory, peaky_model_dir: str) -> str:
    return make_random_head(tmp_path_factory.mktemp("eagle3-head"), peaky_model_dir, "eagle3")


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory: pytest.TempPathFactory, peaky_model_dir: str) -> str:
    return make_random_head(tmp_path_factory.mktemp("eagle-head"), peaky_model_dir, "eagle")


# A cost model under which every verified node is free and a plain step dear: the planner then
# speculates every round with the largest trees the settings allow (their acceptance only has
# to be positive).
FLAT_COST = {"verify": [[1, 10.0], [64, 10.0]], "decode_one": 100.0, "draft": [[1, 0.0, 0.0]]}
_COST_DIR = Path(tempfile.mkdtemp(prefix="spectral-cost-"))
atexit.register(shutil.rmtree, _COST_DIR, ignore_errors=True)


def cost_model_file(cost: dict) -> str:
    """`cost` written as a cost model JSON file (--speculative-cost-model)."""
    path = _COST_DIR / f"cost-{abs(hash(json.dumps(cost, sort_keys=True)))}.json"
    path.write_text(json.dumps(cost))
    return str(path)


def make_spec_scheduler(
    model_dir: str, num_kv_slots: int = 4096, cost: dict | None = None, **options
) -> Scheduler:
    """A float32 scheduler stepped by the test; `options` are ServerArgs fields. Speculation
    plans trees by `cost` (default FLAT_COST) unless the options fix the trees."""
    if options.get("speculative_algorithm") and not (
        options.get("speculative_fixed_tree") or options.get("speculative_hybrid_merge")
    ):
        options.setdefault("speculative_cost_model", cost_model_file(cost or FLAT_COST))
    args = ServerArgs(
        model_path=model_dir,
        dtype="float32",
        device="cpu",
        max_total_tokens=num_kv_slots,
        max_running_requests=options.pop("max_running_requests", 16),
        **{
            # Speculate at every batch size the tests use (the default is tuned for speed).
            "speculative_max_batch_size": 16 if options.get("speculative_algorithm") else None,
            **{k: v for k, v in options.items() if k.startswith(("speculative", "cuda_graph"))},
        },
    )
    model, tokenizer = resolve_model(args)
    limits = SchedulerConfig(
        num_kv_slots=num_kv_slots,
        max_running_requests=args.max_running_requests,
        max_context_len=model.context_len,
        max_prefill_tokens=8192,
        eos_token_ids=(2,),
        vocab_size=model.vocab_size,
        chunked_prefill_size=options.get("chunked_prefill_size"),
        mixed_chunk=options.get("mixed_chunk", False),
    )
    return Scheduler(create_worker(args, model), tokenizer, limits, args.spec)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 5000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def run(
    s: Scheduler,
    batch: list[list[int]],
    max_new_tokens: int = 24,
    at_once: int | None = None,
    **params,
) -> list[Req]:
    """Generate for every prompt, `at_once` requests in flight (all by default)."""
    reqs = [
        Req(f"r{i}", list(p), SamplingParams(max_new_tokens=max_new_tokens, **params))
        for i, p in enumerate(batch)
    ]
    pending = list(reqs)
    at_once = at_once or len(reqs)
    while pending or s.has_work:
        while pending and len(s.running) + len(s.waiting) < at_once:
            s.add_request(pending.pop(0))
        s.step()
    assert scheduler_leaks(s) == []
    return reqs


@pytest.fixture(scope="module")
def plain_outputs(peaky_model_dir: str) -> list[list[int]]:
    s = make_spec_scheduler(peaky_model_dir)
    return [r.output_ids for r in run(s, prompts(20), temperature=0.0)]


SPEC_CASES = {
    "eagle3-topk1-batch1": dict(
        speculative_eagle_topk=1,
        speculative_num_steps=4,
        speculative_num_draft_tokens=5,
        at_once=1,
    ),
    "eagle3-topk4-batch8": dict(
        speculative_eagle_topk=4,
        speculative_num_steps=5,
        speculative_num_draft_tokens=8,
        at_once=8,
    ),
    "eagle3-topk3-batch1": dict(speculative_eagle_topk=3, speculative_num_steps=3, at_once=1),
    "eagle3-fixed-tree-batch4": dict(
        speculative_fixed_tree=True,
        speculative_eagle_topk=2,
        speculative_num_steps=3,
        speculative_num_draft_tokens=6,
        at_once=4,
    ),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_eagle3_greedy_output_equals_plain_decoding(
    case: str, peaky_model_dir: str, eagle3_head: str, plain_outputs: list[list[int]]
) -> None:
    opts = dict(SPEC_CASES[case])
    at_once = opts.pop("at_once")
    s = make_spec_scheduler(
        peaky_model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=eagle3_head,
        **opts,
    )
    count = 10 if at_once == 1 else 20  # one at a time: the first ten
    reqs = run(s, prompts(20)[:count], at_once=at_once, temperature=0.0)
    assert [r.output_ids for r in reqs] == plain_outputs[:count]
    assert s.stats.spec_verify_ct > 0
    assert all(r.spec.verify_ct > 0 for r in reqs)


def test_a_measured_cost_model_times_the_heads_upkeep_apart_and_outputs_stay_plain(
    tmp_path: Path,
    monkeypatch,
    peaky_model_dir: str,
    eagle3_head: str,
    plain_outputs: list[list[int]],
) -> None:
    """Without a cost model file the worker measures one at start-up (and caches it): a plain
    step's time is the target's, the head's upkeep on plain steps of 1 and 4 requests its own
    `idle` points, and the scratch positions it queued are written before anyone is served
    (outputs equal plain decoding's)."""
    from spectral.worker import cost_measure

    monkeypatch.setattr(cost_measure, "CACHE_DIR", tmp_path)
    s = make_spec_scheduler(
        peaky_model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=eagle3_head,
        speculative_cost_model=None,
    )
    model = s.worker.cost_model
    assert [n for n, _ in model.idle] == list(cost_measure.DRAFT_POINTS)
    assert all(ms > 0 for _, ms in model.idle)
    assert model.plain_ms(1) == pytest.approx(model.decode_ms(1) + model.idle[0][1])
    assert model.catch_up == 0.0  # a head's upkeep runs each step: it has nothing to catch up
    assert s.worker.drafter._queue.take() is None  # nothing queued is left to land later
    assert len(list(tmp_path.glob("*.json"))) == 1
    reqs = run(s, prompts(20)[:8], at_once=4, temperature=0.0)
    assert [r.output_ids for r in reqs] == plain_outputs[:8]

    # measured again: the upkeep of each plain step and each draft timed right after a target
    # step (as they run in serving, the target's weights having gone through the caches)
    worker, calls = s.worker, []
    for obj, name in ((worker.target, "run"), (worker, "observe_step"), (worker.drafter, "draft")):
        monkeypatch.setattr(obj, name, recording(getattr(obj, name), name, calls))
    monkeypatch.setattr(worker.target, "forward", recording(worker.target.forward, "run", calls))
    cost_measure.measure(worker)
    after = [calls[i - 1] for i, name in enumerate(calls) if name in ("observe_step", "draft")]
    assert calls.count("observe_step") > cost_measure.IDLE_STEPS and calls.count("draft") > 4
    assert set(after) == {"run"}


def recording(fn, name: str, calls: list[str]):
    """`fn`, appending `name` to `calls` at each call."""

    def recorded(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return recorded


def test_eagle_head_greedy_output_equals_plain_decoding(
    peaky_model_dir: str, eagle_head: str, plain_outputs: list[list[int]]
) -> None:
    s = make_spec_scheduler(
        peaky_model_dir, speculative_algorithm="EAGLE", speculative_draft_model_path=eagle_head
    )
    reqs = run(s, prompts(20), at_once=4, temperature=0.0)
    assert [r.output_ids for r in reqs] == plain_outputs


def eagle3_matches_plain(
    model_dir: str, head: str, batch: list[list[int]], run_options: dict, **scheduler_options
) -> tuple[Scheduler, list[Req]]:
    """Run `batch` greedily without and with EAGLE-3 under the same scheduler options; assert
    equal outputs. Returns the speculative scheduler and its requests."""
    plain = make_spec_scheduler(model_dir, **scheduler_options)
    expected = [r.output_ids for r in run(plain, batch, temperature=0.0, **run_options)]
    s = make_spec_scheduler(
        model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head,
        **scheduler_options,
    )
    reqs = run(s, batch, temperature=0.0, **run_options)
    assert [r.output_ids for r in reqs] == expected
    return s, reqs


def test_radix_hits_and_chunked_prefill_keep_output_equal(
    peaky_model_dir: str, eagle3_head: str
) -> None:
    """Prompts sharing long prefixes (radix hits, the draft KV of the matched prefix reused),
    prefilled in chunks of 16."""
    base = prompts(1, seed=5)[0] * 3
    batch = [base + p for p in prompts(6, seed=6)] + [base + prompts(1, seed=6)[0]]
    _, reqs = eagle3_matches_plain(
        peaky_model_dir, eagle3_head, batch, dict(at_once=2), chunked_prefill_size=16
    )
    assert sum(r.cached_tokens for r in reqs) > 0


def test_retraction_under_a_small_pool_keeps_output_equal(
    peaky_model_dir: str, eagle3_head: str
) -> None:
    s, _ = eagle3_matches_plain(
        peaky_model_dir, eagle3_head, prompts(8, seed=7), dict(max_new_tokens=40), num_kv_slots=260
    )
    assert s.stats.retractions > 0


def test_over_the_batch_limit_the_head_writes_kv_only_and_drafts_as_after_full_extends(
    peaky_model_dir: str, eagle3_head: str, plain_outputs: list[list[int]]
) -> None:
    """8 requests of different lengths with speculation limited to 3 running: plain decode
    steps (the head writes its KV only) until the batch shrinks, then rounds; the drafts equal
    those of a head that ran in full on every step (same accepted tokens per request)."""
    lengths = [6 + 2 * i for i in range(8)]

    def run_varied(s: Scheduler) -> list[Req]:
        reqs = [
            Req(f"v{i}", p, SamplingParams(max_new_tokens=n, temperature=0.0))
            for i, (p, n) in enumerate(zip(prompts(8), lengths))
        ]
        for req in reqs:
            s.add_request(req)
        while s.has_work:
            s.step()
        assert scheduler_leaks(s) == []
        assert [r.output_ids for r in reqs] == [o[:n] for o, n in zip(plain_outputs, lengths)]
        return reqs

    options = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=eagle3_head,
        speculative_max_batch_size=3,
    )

    def recorded_drafts(s: Scheduler) -> list[tuple[torch.Tensor, torch.Tensor]]:
        drafter, drafts = s.worker.drafter, []
        draft = drafter.draft

        def record(rows, seq_lens, num_steps=None, roots=None, root_slots=None):
            scores, tokens, parents = draft(rows, seq_lens, num_steps, roots, root_slots)
            drafts.append((scores.clone(), tokens.clone()))
            return scores, tokens, parents

        drafter.draft = record
        return drafts

    s = make_spec_scheduler(peaky_model_dir, **options)
    drafts = recorded_drafts(s)
    run_varied(s)
    assert 0 < s.stats.spec_verify_ct < s.stats.decode_steps
    full = make_spec_scheduler(peaky_model_dir, **options)
    drafter = full.worker.drafter

    def full_head(batch, features, next_ids=None):  # the full head on every step
        shifted = batch if next_ids is None else shifted_draft_batch(batch, next_ids)
        drafter.extend(shifted, joined(features))

    drafter.write_kv = full_head
    full_drafts = recorded_drafts(full)
    run_varied(full)
    assert len(drafts) == len(full_drafts) > 0
    for (scores, tokens), (full_scores, full_tokens) in zip(drafts, full_drafts):
        assert torch.equal(tokens, full_tokens)
        assert torch.allclose(scores, full_scores, atol=1e-5)


def ngram_scheduler(model_dir: str, **options: object) -> Scheduler:
    return make_spec_scheduler(model_dir, speculative_algorithm="NGRAM", **options)


def test_ngram_accepts_a_continuation_seen_before_and_matches_plain(
    peaky_model_dir: str, plain_outputs: list[list[int]]
) -> None:
    """The second time a prompt runs, its first answer is in the n-gram index: whole paths are
    accepted, and the output is still exactly plain decoding's."""
    batch = prompts(20)
    s = ngram_scheduler(peaky_model_dir, speculative_num_steps=7, speculative_num_draft_tokens=8)
    first = run(s, batch, at_once=8, temperature=0.0)
    again = run(s, batch, at_once=8, temperature=0.0)
    assert [r.output_ids for r in first] == plain_outputs
    assert [r.output_ids for r in again] == plain_outputs
    verify_rounds = sum(r.spec.verify_ct for r in again)
    assert sum(len(r.output_ids) for r in again) / verify_rounds > 3.0
    # flush_cache forgets past requests: the radix tree's and the n-gram index's (whose size
    # and bound /get_server_info reports)
    index = s.info()["caches"]["ngram_index"]
    ngram = s.spec_round.ngram
    assert index == {
        "tokens": ngram.num_indexed_tokens,
        "max_tokens": 1_000_000,
        "bytes": ngram.index.nbytes,
    }
    assert index["tokens"] > 0
    assert s.flush_cache()
    assert s.info()["caches"]["ngram_index"]["tokens"] == 0
    third = run(s, batch[:4], at_once=4, temperature=0.0)
    assert [r.output_ids for r in third] == plain_outputs[:4]
    rounds = sum(r.spec.verify_ct for r in third)  # drafted from the requests' own tokens
    assert rounds == 0 or sum(len(r.output_ids) for r in third) / rounds < 3.0


# Each verified node costs a twentieth of a one-token forward: trees pay only where drafts are
# accepted often.
SLOPED_COST = {
    "verify": [[1, 10.0], [64, 41.5]],
    "decode_one": 10.0,
    "draft": [[1, 0.5, 1.0], [16, 1.0, 2.0]],
}


def test_planned_tree_sizes_follow_acceptance_and_output_stays_plain(
    peaky_model_dir: str, plain_outputs: list[list[int]]
) -> None:
    """Under a cost model where nodes are not free, the planner gives requests whose n-gram
    drafts are accepted larger trees than the others, rounds mix sizes, and every output is
    plain decoding's."""
    seen, new, expected = seen_and_new_prompts(peaky_model_dir, plain_outputs)
    s = ngram_scheduler(
        peaky_model_dir,
        cost=SLOPED_COST,
        speculative_num_steps=7,
        speculative_num_draft_tokens=8,
    )
    run(s, seen, at_once=6, temperature=0.0)
    planned: list[list[int]] = []
    record = s.spec_round.planner.record_plan
    s.spec_round.planner.record_plan = lambda plan, nodes: (
        planned.append(list(nodes)),
        record(plan, nodes),
    )
    again = run(s, seen + new, at_once=12, temperature=0.0)
    assert [r.output_ids for r in again] == expected
    assert any(len(set(nodes)) > 1 for nodes in planned)  # sizes differ within a round
    assert max(max(nodes) for nodes in planned) > 2
    info = s.info()["speculative"]
    assert info["tree_policy"] == "planned" and info["rounds"]["rounds"] == len(planned) > 0
    assert (
        max(v["gain_by_rank"][0] for k, v in info["acceptance"].items() if k.startswith("ngram:"))
        > 0.5
    )


# A verified node costs more than a one-token step: no round can pay, whatever is accepted.
LOSING_COST = {"verify": [[1, 10.0], [64, 700.0]], "decode_one": 10.0, "draft": [[1, 0.5, 1.0]]}


def test_a_planner_whose_cost_model_says_rounds_lose_runs_no_round(
    peaky_model_dir: str, plain_outputs: list[list[int]]
) -> None:
    """Prompts run a second time (the n-gram index holds their whole answers: every draft
    would be accepted), one at a time for more steps than PROBE_EVERY, under a cost model where
    rounds lose: every step is plain (no probe either), the output plain decoding's."""
    batch = prompts(20)[:6]
    s = ngram_scheduler(
        peaky_model_dir, cost=LOSING_COST, speculative_num_steps=7, speculative_num_draft_tokens=8
    )
    run(s, batch, at_once=1, temperature=0.0)
    again = run(s, batch, at_once=1, temperature=0.0)
    assert [r.output_ids for r in again] == plain_outputs[:6]
    assert s.stats.decode_steps > PROBE_EVERY
    assert s.stats.spec_verify_ct == 0
    assert s.info()["speculative"]["rounds"]["probes"] == 0


def seen_and_new_prompts(
    model_dir: str, plain_outputs: list[list[int]]
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Six prompts whose plain outputs are `plain_outputs[:6]`, six others, and the plain
    outputs of all twelve."""
    seen, new = prompts(20)[:6], prompts(6, seed=9)
    plain = make_spec_scheduler(model_dir)
    expected = plain_outputs[:6] + [r.output_ids for r in run(plain, new, temperature=0.0)]
    return seen, new, expected


def hybrid_scheduler(model_dir: str, head: str, **overrides: object) -> Scheduler:
    """EAGLE-3 with n-gram trees of 8 beside head trees of 5 nodes, 4 deep."""
    return make_spec_scheduler(
        model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head,
        speculative_hybrid_ngram=8,
        speculative_num_steps=4,
        speculative_num_draft_tokens=5,
        **overrides,
    )


def test_hybrid_ngram_mixes_ngram_and_head_trees_and_matches_plain(
    peaky_model_dir: str, eagle3_head: str, plain_outputs: list[list[int]]
) -> None:
    """EAGLE-3 with n-gram trees where they match: a batch of prompts seen before (their
    answers are in the n-gram index) and new ones verifies n-gram trees for some requests and
    the head's for the others in the same round; every output is plain decoding's."""
    seen, new, expected = seen_and_new_prompts(peaky_model_dir, plain_outputs)
    s = hybrid_scheduler(peaky_model_dir, eagle3_head)
    first = run(s, seen, at_once=6, temperature=0.0)
    assert [r.output_ids for r in first] == plain_outputs[:6]
    drafter = s.worker.drafter
    head_rows: list[tuple[int, int]] = []  # (rows the head drafted for, batch size) per round
    head_draft = drafter.draft

    def counted(rows: torch.Tensor, *args, **kwargs):
        head_rows.append((rows.numel(), len(s.running)))
        return head_draft(rows, *args, **kwargs)

    drafter.draft = counted
    again = run(s, seen + new, at_once=12, temperature=0.0)
    assert [r.output_ids for r in again] == expected
    assert any(0 < drafted < size for drafted, size in head_rows)  # mixed rounds
    tau_seen = sum(len(r.output_ids) for r in again[:6]) / sum(r.spec.verify_ct for r in again[:6])
    tau_first = sum(len(r.output_ids) for r in first) / sum(r.spec.verify_ct for r in first)
    assert tau_seen > max(3.0, tau_first)


def test_a_head_idling_between_its_trees_keeps_output_plain(
    monkeypatch, peaky_model_dir: str, eagle3_head: str, plain_outputs: list[list[int]]
) -> None:
    """A head that pays (planned every step) sent idle every 16 steps, as a planner that
    gave it no tree for HEAD_IDLE_AFTER tokens would: steps of 32 tokens and the n-gram
    rounds among them ask it for no upkeep (none writes its KV or extends it: it misses those
    positions), one plain step wakes it, and it drafts again; every output, prompts seen
    before and new ones in mixed batches, is plain decoding's."""
    monkeypatch.setattr(round_module, "HEAD_WAKE_AFTER", 32)
    seen, new, expected = seen_and_new_prompts(peaky_model_dir, plain_outputs)
    s = hybrid_scheduler(peaky_model_dir, eagle3_head)
    run(s, seen, at_once=6, temperature=0.0)
    forward, idle_steps, head_rounds = s.worker.forward, [], []
    head_draft = s.worker.drafter.draft

    def recorded(wb):
        idle_steps.append(wb.drafter_idle)
        idle_rounds.append(wb.drafter_idle and wb.mode == ForwardMode.TARGET_VERIFY)
        if len(idle_steps) % 16 == 4:
            s.spec_round.head_idle, s.spec_round._head_tokens = True, 0
        return forward(wb)

    def counted(rows: torch.Tensor, *args, **kwargs):
        head_rounds.append(len(idle_steps))
        return head_draft(rows, *args, **kwargs)

    drafter, idle_rounds, writes = s.worker.drafter, [], []
    write_kv, observe_round = drafter.write_kv, drafter.observe_round

    def written(*args, **kwargs):
        writes.append(idle_steps[-1])
        return write_kv(*args, **kwargs)

    def observed(*args, **kwargs):
        writes.append(idle_steps[-1])
        return observe_round(*args, **kwargs)

    s.worker.forward, drafter.draft = recorded, counted
    drafter.write_kv, drafter.observe_round = written, observed
    again = run(s, seen + new, at_once=4, temperature=0.0)
    assert [r.output_ids for r in again] == expected
    assert sum(idle_steps) >= 6 and head_rounds and writes and not any(writes)
    assert any(idle_rounds)  # n-gram rounds ran while it idled
    assert any(any(idle_steps[: n - 1]) for n in head_rounds)  # drafted after idling


def test_merged_hybrid_trees_verify_ngram_and_head_drafts_together_and_match_plain(
    peaky_model_dir: str, eagle3_head: str, plain_outputs: list[list[int]]
) -> None:
    """With --speculative-hybrid-merge a request whose text repeats verifies the union of its
    n-gram tree and the head's: trees hold head nodes beyond the n-gram chain, and every
    output is plain decoding's."""
    seen, new, expected = seen_and_new_prompts(peaky_model_dir, plain_outputs)
    s = hybrid_scheduler(peaky_model_dir, eagle3_head, speculative_hybrid_merge=True)
    run(s, seen, at_once=6, temperature=0.0)
    worker = s.worker
    merged_sizes: list[int] = []  # real nodes of the trees that joined a given one
    trees_of = worker._trees

    def counted(wb, *args):
        trees, probs = trees_of(wb, *args)
        for b, toks in enumerate(wb.draft_tokens or []):
            if toks:
                merged_sizes.append(trees.num_nodes[b] - 1 - len(toks))
        return trees, probs

    worker._trees = counted
    again = run(s, seen + new, at_once=12, temperature=0.0)
    assert [r.output_ids for r in again] == expected
    assert merged_sizes and max(merged_sizes) > 0  # head nodes beside n-gram chains
    assert max(merged_sizes) <= 4
    assert scheduler_leaks(s) == []


def test_stop_token_inside_an_accepted_path_ends_the_request_there(
    peaky_model_dir: str, plain_outputs: list[list[int]]
) -> None:
    batch = prompts(20)[:4]
    s = ngram_scheduler(peaky_model_dir)
    run(s, batch, temperature=0.0)  # index the answers
    free_before = s.kv.allocator.free_count + s.kv.tree.evictable_size
    for prompt, plain in zip(batch, plain_outputs):
        stop = plain[9]
        end = plain.index(stop) + 1
        (req,) = run(s, [prompt], temperature=0.0, stop_token_ids=[stop])
        assert req.output_ids == plain[:end]
        assert req.finished_reason.type == "stop"
        (req,) = run(s, [prompt], max_new_tokens=7, temperature=0.0)
        assert req.output_ids == plain[:7]
        assert req.finished_reason.type == "length"
    assert s.kv.allocator.free_count + s.kv.tree.evictable_size == free_before


def test_mixed_sampling_in_one_batch(peaky_model_dir: str, eagle3_head: str) -> None:
    """Greedy requests keep plain decoding's output next to sampled ones, penalised ones and
    ones that ask for logprobs; every request ends with the length it asked for."""
    batch = prompts(8, seed=11)
    plain = make_spec_scheduler(peaky_model_dir)
    expected = [r.output_ids for r in run(plain, batch[:4], temperature=0.0)]
    s = make_spec_scheduler(
        peaky_model_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle3_head
    )
    reqs = [
        Req(f"g{i}", p, SamplingParams(max_new_tokens=24, temperature=0.0), return_logprob=True)
        for i, p in enumerate(batch[:4])
    ]
    reqs += [
        Req(f"s{i}", p, SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=i))
        for i, p in enumerate(batch[4:6])
    ]
    reqs += [
        Req(f"p{i}", p, SamplingParams(max_new_tokens=24, temperature=0.0, frequency_penalty=1.5))
        for i, p in enumerate(batch[6:])
    ]
    for r in reqs:
        s.add_request(r)
    while s.has_work:
        s.step()
    assert scheduler_leaks(s) == []
    assert [r.output_ids for r in reqs[:4]] == expected
    assert all(len(r.output_ids) == 24 for r in reqs)
    assert all(len(r.output_logprobs) == 24 for r in reqs[:4])
    penalised = run(plain, batch[6:], temperature=0.0, frequency_penalty=1.5)
    assert [r.output_ids for r in reqs[6:]] == [r.output_ids for r in penalised]


def test_abort_mid_generation_frees_everything(peaky_model_dir: str, eagle3_head: str) -> None:
    s = make_spec_scheduler(
        peaky_model_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle3_head
    )
    reqs = [Req(f"a{i}", p, SamplingParams(max_new_tokens=60)) for i, p in enumerate(prompts(4))]
    for r in reqs:
        s.add_request(r)
    for _ in range(4):
        s.step()
    s.abort("a1")
    s.abort("a3")
    while s.has_work:
        s.step()
    assert scheduler_leaks(s) == []
    assert reqs[1].finished_reason.type == "abort"


def test_settings_refuse_what_cannot_work(tmp_path: Path, peaky_model_dir: str) -> None:
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(model_path=peaky_model_dir, speculative_algorithm="EAGLE3")
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="EAGLE")
    # The embedded default model comes with its head.
    assert ServerArgs(speculative_algorithm="EAGLE3").spec.draft_model_path == "default"
    with pytest.raises(ValueError, match="NGRAM drafts without a model"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_draft_model_path="x")
    with pytest.raises(ValueError, match="ngram_min_match_window_size <="):
        ServerArgs(
            speculative_algorithm="NGRAM",
            speculative_ngram_min_match_window_size=5,
            speculative_ngram_max_match_window_size=3,
        )
    # NGRAM's trees start from one-token matches, a hybrid's from two; the flag decides over both.
    ngram = ServerArgs(speculative_algorithm="NGRAM").spec
    assert (ngram.ngram_min_match, ngram.ngram_max_match) == (1, 4)
    assert ServerArgs(speculative_algorithm="EAGLE3").spec.ngram_min_match == 2
    flagged = ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=3)
    assert flagged.spec.ngram_min_match == 3
    with pytest.raises(ValueError, match="pairs n-gram drafts with a drafter"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_hybrid_ngram=8)
    with pytest.raises(ValueError, match="the n-gram tree size, root included: >= 2"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_hybrid_ngram=1)
    with pytest.raises(ValueError, match="needs EAGLE or EAGLE3 with --speculative-hybrid-ngram"):
        ServerArgs(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path="x",
            speculative_hybrid_ngram=0,
            speculative_hybrid_merge=True,
        )
    with pytest.raises(
        ValueError, match="must be one of EAGLE, EAGLE3, STANDALONE, MEDUSA, NGRAM, LOOKAHEAD"
    ):
        ServerArgs(speculative_algorithm="JACOBI")
    with pytest.raises(ValueError, match="LOOKAHEAD drafts without a model"):
        ServerArgs(speculative_algorithm="LOOKAHEAD", speculative_draft_model_path="x")
    with pytest.raises(ValueError, match="lookahead-window >= 1.*got 0, 3, 2"):
        ServerArgs(speculative_algorithm="LOOKAHEAD", speculative_lookahead_window=0)
    with pytest.raises(ValueError, match="MEDUSA needs --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="MEDUSA")
    with pytest.raises(ValueError, match="exceeds what 2 steps of top-2 can draft"):
        ServerArgs(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path="x",
            speculative_num_steps=2,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=9,
        )


def test_a_head_for_another_target_is_refused_with_what_differs(
    tmp_path: Path, peaky_model_dir: str, tiny_model_dir: str, default_model_dir: str
) -> None:
    head = make_random_head(tmp_path / "head", default_model_dir, "eagle3")
    with pytest.raises(ValueError, match="expects target hidden size 576, the target has 64"):
        make_spec_scheduler(
            peaky_model_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=head
        )
    eagle1 = make_random_head(tmp_path / "eagle1", peaky_model_dir, "eagle")
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        make_spec_scheduler(
            peaky_model_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle1
        )


def test_a_shallower_draft_gives_the_same_small_tree(
    peaky_model_dir: str, eagle3_head: str
) -> None:
    """The worker drafts no deeper than a tree of n nodes can reach (n - 1 levels): the best
    n - 1 candidates, and their ranks, are those of the full-depth draft."""
    s = make_spec_scheduler(
        peaky_model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=eagle3_head,
        speculative_eagle_topk=3,
        speculative_num_steps=5,
        speculative_num_draft_tokens=12,
    )
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=8)) for i, p in enumerate(prompts(3))]
    for req in reqs:
        s.add_request(req)
    s.step()  # the prefill: the head's top-k after each prompt
    drafter = s.worker.drafter
    rows = torch.tensor([r.req_pool_idx for r in reqs])
    seq_lens = torch.tensor([len(r.input_ids) for r in reqs])
    roots = torch.tensor([r.output_ids[-1] for r in reqs])
    full = drafter.draft(rows, seq_lens)
    for n in (2, 3, 4, 6):
        shallow = drafter.draft(rows, seq_lens, num_steps=n - 1)
        assert shallow[0].shape[1] < full[0].shape[1] or n - 1 >= 5
        a = select_eagle_trees(roots, *full, n)
        b = select_eagle_trees(roots, *shallow, n)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert torch.equal(a.ranks, b.ranks)
    while s.has_work:
        s.step()


def test_queued_head_kv_writes_land_before_the_head_reads_and_the_newest_wins(
    peaky_model_dir: str, eagle3_head: str
) -> None:
    """write_kv defers the head's KV: nothing is written until a read (or a full queue), then
    every queued slot holds what the head computes for it, a slot queued twice its newest."""
    from spectral.core.forward import ForwardBatch, ForwardMode

    s = make_spec_scheduler(
        peaky_model_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle3_head
    )
    drafter = s.worker.drafter
    head = drafter.head
    feature_size = head.cfg.feature_size

    def batch(slots: list[int], ids: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor(ids),
            positions=torch.tensor([5] * len(ids)),
            out_cache_loc=torch.tensor(slots),
            req_pool_indices=torch.arange(len(ids)),
            prefix_lens=[5] * len(ids),
            extend_lens=[1] * len(ids),
        )

    torch.manual_seed(0)
    first, second = torch.randn(2, feature_size), torch.randn(1, feature_size)
    drafter.kv_pool.k[0][[11, 12]] = -7.0  # the pool is not initialised: NaN != NaN
    before = drafter.kv_pool.k[0][[11, 12]].clone()
    drafter.write_kv(batch([11, 12], [7, 8]), first)
    drafter.write_kv(batch([11], [9]), second)
    assert torch.equal(drafter.kv_pool.k[0][[11, 12]], before)  # queued, not written
    drafter.flush()
    k, v = head.kv(torch.tensor([9, 8]), torch.cat((second, first[1:])), torch.tensor([5, 5]))
    assert torch.equal(drafter.kv_pool.k[0][[11, 12]], k)
    assert torch.equal(drafter.kv_pool.v[0][[11, 12]], v)
