"""On a CUDA GPU: the Triton and FlashInfer attention backends against the torch backend in
every forward mode, sampling and verification on the device, and speculative decoding with
EAGLE3 giving plain decoding's tokens in float32, and (with two GPUs) tensor parallelism over
NCCL. Skipped where torch sees no GPU.

Nothing here reads the default model (a lent GPU has no copy): the engines serve tiny models
with random weights made on the device (--load-format dummy), whose config and tokenizer
bench/shapes.py writes."""

from __future__ import annotations

import collections
import functools
import random
import warnings
from pathlib import Path

import pytest
import torch

from spectral.attention.registry import create_attention_backend
from spectral.attention.torch_backend import TorchAttentionBackend
from spectral.core.forward import ForwardMode
from tests.attention_cases import CASES, SHAPES, random_case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none on this machine)"
)

MODES = CASES + [
    (ForwardMode.DRAFT_EXTEND, [5, 0, 30], [2, 4, 1]),
    (ForwardMode.DRAFT_DECODE, [3, 20, 8], [4, 1, 7]),
]
TRITON = [
    ("triton", torch.float32, 1e-4),
    ("triton", torch.bfloat16, 3e-2),
    ("triton", torch.float16, 1e-2),
]
# FlashInfer compiles one JIT module per dtype and head dim (~30 s of nvcc on 16 cores): the
# head dims of the models measured (64: the default's; 128: Qwen2.5-1.5B's), float16 at one.
FLASHINFER = [
    pytest.param("flashinfer", torch.bfloat16, 3e-2, shape) for shape in ((9, 3, 64), (12, 2, 128))
] + [pytest.param("flashinfer", torch.float16, 1e-2, (12, 2, 128))]
CASES_BY_BACKEND = [
    (*backend, shape) for backend in TRITON for shape in SHAPES + [(32, 8, 128)]
] + FLASHINFER


@pytest.mark.parametrize(("name", "dtype", "tolerance", "shape"), CASES_BY_BACKEND, ids=str)
def test_backend_equals_the_torch_backend_in_every_mode(name, dtype, tolerance, shape):
    rng = random.Random(3)
    for mode, prefixes, news in MODES:
        cpu = random_case(rng, mode, prefixes, news, *shape)
        oracle = TorchAttentionBackend(cpu.pool, cpu.table, cpu.scaling, kernels=None)
        oracle.init_forward_metadata(cpu.batch)
        expected = oracle.forward(cpu.q, cpu.k, cpu.v, 0, cpu.batch)
        case = cpu.to("cuda", dtype)
        backend = create_attention_backend(name, case.pool, case.table, case.scaling, "cuda")
        backend.init_forward_metadata(case.batch)
        got = backend.forward(case.q, case.k, case.v, 0, case.batch).float().cpu()
        err = float((got - expected).abs().max())
        assert err < tolerance, f"{name} {dtype} {mode.name}: max error {err:.2e}"


def test_sampling_on_the_device_equals_the_cpu_and_syncs_a_fixed_number_of_times():
    """Greedy, seeded (the noise comes from CPU generators) and penalised rows give the CPU's
    tokens and logprobs; the host waits on the device as often for 12 rows as for 6."""
    from spectral.core.worker_io import RequestSampling
    from spectral.sampling_params import SamplingParams
    from spectral.worker.sampler import sample

    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=11, top_k=50),
        SamplingParams(temperature=1.0, seed=12, top_p=0.9),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.9, seed=13, min_p=0.1),
        SamplingParams(temperature=0.0),
    ]

    def run(rows: int) -> int:
        logits = torch.randn((rows, 4096), generator=torch.Generator().manual_seed(rows)) * 4
        sampling = [
            RequestSampling(
                params[i % len(params)],
                f"r{i}",
                output_ids=[1, 2, 3],
                penalty_prompt_ids=[4, 5],
                return_logprob=True,
                top_logprobs_num=i % 3,
            )
            for i in range(rows)
        ]
        on_cpu = sample(logits, sampling)

        def on_device():
            out = sample(logits.cuda(), sampling)
            return out, out.next_token_ids.tolist()

        (on_gpu, tokens), waits = host_waits(on_device)
        assert tokens == on_cpu.next_token_ids.tolist()
        assert on_gpu.logprobs == pytest.approx(on_cpu.logprobs, abs=1e-4)
        for got, want in zip(on_gpu.top_logprobs, on_cpu.top_logprobs):
            assert (got is None) == (want is None)
            if got:
                assert [t for _, t in got] == [t for _, t in want]
        return waits

    run(6)  # first uses (the pinned-memory pool, the device generator) wait once, not per step
    # at least the tokens' copy back waits: a count of 0 would mean no warning was caught
    assert run(12) == run(6) >= 1


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> tuple[str, str]:
    """A tiny model directory (random weights come at load) and a random EAGLE-3 head for it."""
    from bench.shapes import make_model_dir
    from tests.test_speculative import make_random_head

    model_dir = make_model_dir(tmp_path_factory.mktemp("tiny"), "tiny")
    return model_dir, make_random_head(tmp_path_factory.mktemp("head"), model_dir, "eagle3")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_eagle3_on_the_gpu_gives_plain_decodings_tokens_in_float32(tiny_model, backend):
    from spectral import Engine

    model_dir, head_dir = tiny_model
    prompts = [[5 + i, 40 + 3 * i, 7, 300 + i, 11, 12][: 3 + i] for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    # A fixed tree every round: a random head's drafts are rarely accepted, which the planner
    # would rightly decline to verify.
    eagle3 = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": head_dir,
        "speculative_fixed_tree": True,
        "speculative_max_batch_size": 4,
    }
    outputs, rounds = [], 0
    for spec in ({}, eagle3):
        engine = Engine(
            model_path=model_dir,
            dtype="float32",
            device="cuda",
            load_format="dummy",
            attention_backend=backend,
            max_total_tokens=8192,
            **spec,
        )
        # Weights 50x the initialisation's: sharp next-token distributions, far from ties.
        target = engine.worker.target if spec else engine.worker
        for name, param in target.model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(50)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        outputs.append([o["output_ids"] for o in outs])
        rounds = engine.scheduler.stats.spec_verify_ct
        engine.shutdown()
    assert all(len(out) == 48 for out in outputs[0]), "plain decoding ended a request early"
    assert outputs[0] == outputs[1]
    assert rounds > 0


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs two CUDA GPUs for NCCL (torch sees {torch.cuda.device_count()})",
)
def test_two_nccl_ranks_decode_as_one_worker(tmp_path, tiny_model):
    """Tensor parallelism over NCCL: two ranks, one GPU each, give one worker's greedy tokens
    and logits (the gloo test's oracle, tests/test_parallel_layers.py)."""
    import torch.multiprocessing as mp

    from tests.test_parallel_layers import _worker_rank

    model_dir, _ = tiny_model
    init = f"file://{tmp_path / 'rendezvous'}"
    options = {"dummy_weights": True}
    cases = [(model_dir, options)]
    mp.spawn(_worker_rank, args=(2, init, cases, "nccl"), nprocs=2, join=True)


class Waits(int):
    """A count of host waits, with the lines that made them (file:line -> count)."""

    sites: collections.Counter

    def __new__(cls, sites: collections.Counter) -> Waits:
        waits = super().__new__(cls, sum(sites.values()))
        waits.sites = sites
        return waits


def host_waits(run):
    """`run()`'s result and how many times it made the host wait on the device (the sync
    debug mode's warnings), as `Waits` (which names the lines that waited)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    return out, Waits(sites)


def eagle3_fixed_trees(head_dir: str, **options) -> dict:
    """EAGLE3 with fixed trees of 8 tokens (3 levels of top-4), no n-gram trees."""
    return {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": head_dir,
        "speculative_fixed_tree": True,
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 4,
        "speculative_num_draft_tokens": 8,
        "speculative_hybrid_ngram": 0,
        **options,
    }


def _graph_engines(tiny_model, backend: str, spec: dict, graphs: bool):
    from spectral import Engine

    model_dir, _ = tiny_model
    engine = Engine(
        model_path=model_dir,
        dtype="float32" if backend == "triton" else "bfloat16",
        device="cuda",
        load_format="dummy",
        attention_backend=backend,
        max_total_tokens=16384,
        disable_cuda_graph=not graphs,
        cuda_graph_bs=[1, 2, 4, 8, 16],
        **spec,
    )
    target = engine.worker.target if spec else engine.worker
    torch.manual_seed(0)
    for name, param in target.model.named_parameters():  # the same sharp weights both times
        param.copy_(torch.randn_like(param) * (1.0 if name.endswith("norm.weight") else 0.5))
    return engine


def _batches_of_1_3_16(engine) -> list[list[list[int]]]:
    """Greedy outputs of batches of 1, 3 and 16 requests that finish at different steps; the
    scheduler leaks nothing after."""
    from tests.conftest import scheduler_leaks

    outputs = []
    for batch in (1, 3, 16):
        prompts = [[5 + i, 40 + 3 * i, 7, 300 + i][: 2 + i % 3] for i in range(batch)]
        params = [
            {"temperature": 0, "max_new_tokens": 8 + 4 * (i % 5), "ignore_eos": True}
            for i in range(batch)
        ]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        outputs.append([o["output_ids"] for o in outs])
    assert scheduler_leaks(engine.scheduler) == []
    return outputs


@pytest.mark.parametrize(
    ("backend", "algorithm"),
    [
        ("triton", None),
        ("triton", "EAGLE3"),
        pytest.param("flashinfer", None),
        pytest.param("flashinfer", "EAGLE3"),
    ],
)
def test_graph_replay_gives_the_eager_tokens(tiny_model, backend, algorithm):
    """Greedy decoding (and EAGLE3 drafting and tree verification) replaying CUDA graphs gives
    the eager forwards' tokens at batches 1, 3 and 16, requests finishing mid-run; the pool is empty
    after."""
    _, head_dir = tiny_model
    spec = eagle3_fixed_trees(head_dir, speculative_max_batch_size=16) if algorithm else {}
    runs = {}
    for graphs in (False, True):
        engine = _graph_engines(tiny_model, backend, spec, graphs)
        try:
            outputs = _batches_of_1_3_16(engine)
            info = engine.worker.graph_info()
            assert bool(info and info["captured"]) == graphs
            if algorithm and graphs:  # verification, the head's tree levels and extends too
                assert info["verify_tree_sizes"], info
                assert info["draft"]["captured"] and info["draft"]["extend"]["captured"]
                assert engine.worker.drafter.graphs.static_runs > 0
                assert engine.worker.drafter.extend_graphs.static_runs > 0
        finally:
            engine.shutdown()
        runs[graphs] = outputs
    assert runs[True] == runs[False]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_decode_steps_launched_ahead_give_the_tokens_of_steps_in_turn(tiny_model, backend):
    """The overlap scheduler (on by default on a GPU) replaying graphs: the tokens of the
    scheduler that waits for each step, batches 1, 3 and 16 finishing at different steps, most
    steps launched ahead, the pool empty after."""
    runs = []
    for overlap in (False, True):
        engine = _graph_engines(tiny_model, backend, {}, graphs=True)
        engine.scheduler.overlap = engine.scheduler.overlap if overlap else None
        try:
            outputs = _batches_of_1_3_16(engine)
            ahead = engine.scheduler.stats.decode_steps_ahead
            assert (ahead > 10) == overlap, ahead
        finally:
            engine.shutdown()
        runs.append(outputs)
    assert runs[0] == runs[1]


def test_a_graphed_decode_step_waits_on_the_device_only_for_its_result(tiny_model):
    """A decode step replaying a graph (inputs staged through pinned memory, the table written
    on the device) makes the host wait once: the sampled tokens coming back."""
    from spectral.core.worker_io import RequestSampling, WorkerBatch
    from spectral.sampling_params import SamplingParams

    engine = _graph_engines(tiny_model, "triton", {}, graphs=True)
    try:
        worker = engine.worker
        greedy = RequestSampling(SamplingParams(temperature=0.0), "r")
        prefill = WorkerBatch(
            mode=ForwardMode.EXTEND,
            input_ids=[5, 6, 7, 8],
            positions=[0, 1, 2, 3],
            out_cache_loc=[1, 2, 3, 4],
            req_pool_indices=[0],
            prefix_lens=[0],
            extend_lens=[4],
            sampling=[greedy],
        )
        worker.forward(prefill)
        counts = []
        for step in range(3):
            decode = WorkerBatch(
                mode=ForwardMode.DECODE,
                input_ids=[9 + step],
                positions=[4 + step],
                out_cache_loc=[5 + step],
                req_pool_indices=[0],
                prefix_lens=[4 + step],
                extend_lens=[1],
                sampling=[greedy],
            )
            counts.append(host_waits(functools.partial(worker.forward, decode))[1])
        assert counts[1:] == [1, 1], f"host waits per decode step: {counts}"
    finally:
        engine.shutdown()


def test_a_graphed_eagle3_round_waits_on_the_device_twice(tiny_model):
    """A greedy EAGLE3 round under CUDA graphs (drafted, selected, verified and accepted on the
    device) makes the host wait twice: its result, then the head's confidence after its
    extend. Measured as the difference between a long and a short generation, per round."""
    _, head_dir = tiny_model
    engine = _graph_engines(tiny_model, "triton", eagle3_fixed_trees(head_dir), graphs=True)
    try:

        def run(tokens: int) -> tuple[int, int]:
            before = engine.scheduler.stats.spec_verify_ct
            params = {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}
            _, waits = host_waits(
                lambda: engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=params)
            )
            return waits, engine.scheduler.stats.spec_verify_ct - before

        run(8)  # first uses
        short, long = run(8), run(40)
        assert long[1] > short[1] >= 1
        assert engine.worker.rounds_on_device >= long[1] + short[1]
        assert short[0] >= 2 * short[1], f"fewer waits than rounds: {short}"
        sites = long[0].sites - short[0].sites  # the lines that waited more in more rounds
        assert (long[0] - short[0]) == 2 * (long[1] - short[1]), (
            f"waits, rounds: {short} {long}; waits by line: {dict(sites)}"
        )
    finally:
        engine.shutdown()


def test_replayed_draft_expansions_equal_eager_ones(tiny_model):
    """The head's tree levels replayed from their CUDA graphs (batch sizes 1 and 4, depths 2
    and 3; 3 requests padded to 4) give the eager expansion's candidates, and its extend after
    a round replayed the eager extend's top-k."""
    from spectral.core.req import Req
    from spectral.sampling_params import SamplingParams

    _, head_dir = tiny_model
    spec = eagle3_fixed_trees(head_dir, speculative_max_batch_size=4)
    engine = _graph_engines(tiny_model, "triton", spec, graphs=True)
    try:
        drafter = engine.worker.drafter
        assert (4, 3) in drafter.graphs.graphs and (1, 2) in drafter.graphs.graphs
        scheduler = engine.scheduler
        reqs = [Req(f"r{i}", [5 + i, 6, 7, 8][: 2 + i], SamplingParams()) for i in range(3)]
        for req in reqs:  # prefilled: each row's top-k after its prompt
            scheduler.add_request(req)
        scheduler.step()
        rows = torch.tensor([r.req_pool_idx for r in reqs], device="cuda")
        seq_lens = torch.tensor([len(r.input_ids) for r in reqs], device="cuda")
        for count, steps in ((1, 2), (3, 3)):
            replayed = drafter.draft(rows[:count], seq_lens[:count], steps)
            eager = drafter.expand(rows[:count], seq_lens[:count], steps)
            assert torch.allclose(replayed[0], eager[0], atol=1e-4)
            assert torch.equal(replayed[1], eager[1]) and torch.equal(replayed[2], eager[2])
        # a round's extend (1, 2 and 1 tokens accepted) replayed, then run eagerly on the
        # same buffers: the same top-k
        extends = drafter.extend_graphs
        assert sorted(extends.graphs) == [1, 2, 4]  # cuda_graph_bs up to the spec's 4
        tokens = [[11, 12][: 1 + i % 2] for i in range(3)]
        last = engine.worker.target.num_kv_slots
        slots = torch.arange(last - 4, last, device="cuda")  # free: the pool's last
        prefix = [len(r.input_ids) for r in reqs]
        for req, start, first, own in zip(reqs, prefix, (0, 1, 3), tokens):
            drafter.req_to_token.write(req.req_pool_idx, start, slots[first : first + len(own)])
        features = torch.randn(
            4, drafter.head.cfg.feature_size, device="cuda", dtype=drafter.last_hidden.dtype
        )
        assert extends.run(rows.tolist(), prefix, tokens, slots, features)
        replayed = drafter.topk_logprobs[rows].clone(), drafter.topk_ids[rows].clone()
        drafter.extend_rows(*extends.inputs(4))
        assert torch.allclose(replayed[0], drafter.topk_logprobs[rows], atol=1e-3)
        assert torch.equal(replayed[1], drafter.topk_ids[rows])
        while scheduler.has_work:
            scheduler.step()
    finally:
        engine.shutdown()
