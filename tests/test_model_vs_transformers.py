"""The model computes what transformers computes on the same weights (float32).

The PyTorch path matches transformers' float32 logits to within 1e-4. The C++ kernels sum in
another order (and the order depends on the CPU's vector width), so their oracle is transformers
in float64: their error must be of the size of transformers' own float32 error against it."""

from __future__ import annotations

import copy

import pytest
import torch

from spectral.core.forward import ForwardMode
from spectral.core.worker_io import WorkerBatch
from spectral.worker.model_worker import ModelWorker
from tests.conftest import make_worker

PROMPTS = [
    "The capital of France is",
    "def quicksort(xs):\n    if len(xs) <= 1:",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module", params=[True, False], ids=["cpu-kernels", "pytorch"])
def worker(request, default_model_dir: str) -> ModelWorker:
    return make_worker(default_model_dir, 4096, 1024, use_cpu_kernels=request.param)


def run_extend(
    worker: ModelWorker, ids: list[int], prefix: int, row: int, slots: list[int], capture=()
):
    """Forward ids[prefix:] on top of the first `prefix` tokens already cached in `slots`."""
    n = len(ids)
    wb = WorkerBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids[prefix:],
        positions=list(range(prefix, n)),
        out_cache_loc=slots[prefix:n],
        req_pool_indices=[row],
        prefix_lens=[prefix],
        extend_lens=[n - prefix],
        sampling=[],
    )
    fb = worker.to_forward_batch(wb)
    fb.capture_layers = tuple(capture)
    hidden, captured = worker.forward_hidden(fb)
    return worker.model.compute_logits(hidden), captured


@pytest.fixture(scope="module")
def hf_model_f64(hf_model) -> torch.nn.Module:
    return copy.deepcopy(hf_model).double()


def assert_logits_match(worker, hf_model, hf_model_f64, ids: list[int], logits, start: int = 0):
    with torch.no_grad():
        f32 = hf_model(torch.tensor([ids])).logits[0, start:]
        f64 = hf_model_f64(torch.tensor([ids])).logits[0, start:]
    assert logits.shape == f32.shape
    if worker.model.kernels is None:
        assert (logits - f32).abs().max().item() < 1e-4
    ours = (logits.double() - f64).abs().max().item()
    theirs = (f32.double() - f64).abs().max().item()
    assert ours <= 4 * max(theirs, 1e-6), (ours, theirs)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(worker, hf_model, hf_model_f64, tokenizer, prompt):
    ids = tokenizer(prompt)["input_ids"]
    logits, _ = run_extend(worker, ids, 0, 0, list(range(1, len(ids) + 1)))
    assert_logits_match(worker, hf_model, hf_model_f64, ids, logits)


def test_prefix_then_extend_matches_one_pass(worker, hf_model, hf_model_f64, tokenizer):
    ids = tokenizer(PROMPTS[1] + " return xs\n    pivot = xs[0]")["input_ids"]
    slots = list(range(101, 101 + len(ids)))
    split = len(ids) // 2
    run_extend(worker, ids[:split], 0, 1, slots)
    logits, _ = run_extend(worker, ids, split, 1, slots)
    assert_logits_match(worker, hf_model, hf_model_f64, ids, logits, start=split)


def test_captured_hidden_states_match_transformers(worker, hf_model, tokenizer):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    layers = (2, 15, 27)
    _, captured = run_extend(worker, ids, 0, 2, list(range(201, 201 + len(ids))), capture=layers)
    with torch.no_grad():
        hs = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert len(captured) == 3
    for layer, got in zip(layers, captured):
        expected = hs[layer][0]
        # hidden states reach magnitudes in the hundreds: compare relative to the largest
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() < 1e-5 * scale


def test_batch_of_mixed_lengths_matches_single_requests(worker, tokenizer):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    singles = []
    base = 1000
    for ids in prompts:
        logits, _ = run_extend(worker, ids, 0, 3, list(range(base, base + len(ids))))
        singles.append(logits[-1])
        base += len(ids)
    input_ids, positions, loc = [], [], []
    for ids in prompts:
        input_ids += ids
        positions += list(range(len(ids)))
    loc = list(range(2000, 2000 + len(input_ids)))
    wb = WorkerBatch(
        mode=ForwardMode.EXTEND,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=loc,
        req_pool_indices=[0, 1, 2],
        prefix_lens=[0, 0, 0],
        extend_lens=[len(p) for p in prompts],
        sampling=[],
    )
    logits = worker.forward_logits(worker.to_forward_batch(wb))
    for got, expected in zip(logits, singles):
        assert (got - expected).abs().max().item() < 1e-4
