"""On a CUDA GPU: the Triton and FlashInfer attention backends against the torch backend in
every forward mode, sampling and verification on the device, and speculative decoding with
EAGLE3 giving plain decoding's tokens in float32. Skipped where torch sees no GPU."""

from __future__ import annotations

import importlib.util
import random
import warnings

import pytest
import torch

from spectral.forward import ForwardMode
from spectral.kernels.base import create_attention_backend
from spectral.kernels.torch_backend import TorchAttentionBackend
from tests.attention_cases import CASES, SHAPES, random_case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none on this machine)"
)

MODES = CASES + [
    (ForwardMode.DRAFT_EXTEND, [5, 0, 30], [2, 4, 1]),
    (ForwardMode.DRAFT_DECODE, [3, 20, 8], [4, 1, 7]),
]
NEEDS_FLASHINFER = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
)
BACKENDS = [
    ("triton", torch.float32, 1e-4),
    ("triton", torch.bfloat16, 3e-2),
    ("triton", torch.float16, 1e-2),
    pytest.param("flashinfer", torch.bfloat16, 3e-2, marks=NEEDS_FLASHINFER),
    pytest.param("flashinfer", torch.float16, 1e-2, marks=NEEDS_FLASHINFER),
]


@pytest.mark.parametrize(("name", "dtype", "tolerance"), BACKENDS)
@pytest.mark.parametrize("shape", SHAPES + [(32, 8, 128)], ids=str)
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
    from spectral.sampling_params import SamplingParams
    from spectral.worker.io import RequestSampling
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                on_gpu = sample(logits.cuda(), sampling)
                tokens = on_gpu.next_token_ids.tolist()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert tokens == on_cpu.next_token_ids.tolist()
        assert on_gpu.logprobs == pytest.approx(on_cpu.logprobs, abs=1e-4)
        for got, want in zip(on_gpu.top_logprobs, on_cpu.top_logprobs):
            assert (got is None) == (want is None)
            if got:
                assert [t for _, t in got] == [t for _, t in want]
        return sum("synchroniz" in str(w.message) for w in caught)

    assert run(12) == run(6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_eagle3_on_the_gpu_gives_plain_decodings_tokens_in_float32(default_model_dir, backend):
    from spectral import Engine

    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
        "1, 2, 3, 5, 8, 13,",
    ]
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    eagle3 = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "default"}
    outputs, rounds = [], 0
    for spec in ({}, eagle3):
        engine = Engine(
            model_path=default_model_dir,
            dtype="float32",
            device="cuda",
            attention_backend=backend,
            max_total_tokens=8192,
            **spec,
        )
        outputs.append([o["output_ids"] for o in engine.generate(prompts, params)])
        rounds = engine.scheduler.stats.spec_verify_ct
        engine.shutdown()
    assert outputs[0] == outputs[1]
    assert rounds > 0
