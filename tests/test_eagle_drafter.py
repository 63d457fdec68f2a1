"""The EAGLE drafter takes its attention backend from the registry by name, as the target does,
and the draft heads score through the LM-head layer the models use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectral.attention.registry import create_attention_backend
from spectral.attention.torch_backend import TorchAttentionBackend
from spectral.layers.logits import LogitsHead
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool
from spectral.speculative.drafters.eagle import EagleDrafter
from spectral.speculative.drafters.eagle_head import DraftHead, DraftHeadConfig

HIDDEN, VOCAB = 32, 64


def tiny_head(kind: str = "eagle3") -> DraftHead:
    cfg = DraftHeadConfig(
        kind=kind,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        vocab_size=VOCAB,
        draft_vocab_size=16 if kind == "eagle3" else VOCAB,
        target_hidden_size=HIDDEN,
        fc_bias=kind == "eagle",
        aux_layers=(0, 1, 2) if kind == "eagle3" else (),
    )
    torch.manual_seed(0)
    head = DraftHead(cfg, max_positions=32)
    for param in head.parameters():
        param.data.normal_(0.0, 0.1)
    return head


def drafter(backend: str, dtype: torch.dtype = torch.float32) -> EagleDrafter:
    table = ReqToTokenPool(max_requests=2, max_context_len=32)
    return EagleDrafter(
        tiny_head(),
        64,
        table,
        topk=2,
        num_steps=2,
        dtype=dtype,
        device="cpu",
        attention_backend=backend,
    )


def test_the_drafter_attends_through_the_torch_backend_by_default() -> None:
    table = ReqToTokenPool(max_requests=2, max_context_len=32)
    d = EagleDrafter(tiny_head(), 64, table, topk=2, num_steps=2, dtype=torch.float32, device="cpu")
    assert type(d.backend) is TorchAttentionBackend


def test_auto_resolves_for_the_drafter_as_for_the_target_on_a_cpu() -> None:
    assert type(drafter("auto").backend) is TorchAttentionBackend


def test_a_backend_that_refuses_the_kv_dtype_refuses_the_drafter_with_the_targets_error() -> None:
    pool = KVPool(8, 1, 2, 8, torch.float32)
    with pytest.raises(ValueError) as target_error:
        create_attention_backend("flashinfer", pool, ReqToTokenPool(2, 32), 0.125, "cpu")
    with pytest.raises(ValueError, match="takes a float16 or bfloat16 KV cache") as draft_error:
        drafter("flashinfer", torch.float32)
    assert str(draft_error.value) == str(target_error.value)


def test_an_unknown_backend_name_is_refused_with_the_names_there_are() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'paged'; available: auto"):
        drafter("paged")


def test_logits_are_hidden_times_the_head_weight_in_float32() -> None:
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)
    hidden = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    logits = LogitsHead(weight)(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(hidden, weight).float())


def test_a_weight_given_as_a_function_is_read_at_every_call() -> None:
    owner = {"weight": torch.zeros(VOCAB, HIDDEN)}
    head = LogitsHead(lambda: owner["weight"])
    owner["weight"] = torch.ones(VOCAB, HIDDEN)
    assert torch.equal(head(torch.ones(1, HIDDEN)), torch.full((1, VOCAB), float(HIDDEN)))


def test_an_eagle3_head_scores_its_normed_output_with_its_own_lm_head() -> None:
    head = tiny_head("eagle3")
    hidden = torch.randn(3, HIDDEN)
    expected = F.linear(head.norm(hidden)[0], head.lm_head.weight).float()
    assert torch.equal(head.logits(hidden), expected)


def test_an_eagle1_head_scores_with_the_target_lm_head_it_is_given() -> None:
    head = tiny_head("eagle")
    embed, lm_head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    head.set_target(embed, lm_head)
    hidden = torch.randn(3, HIDDEN)
    assert torch.equal(head.logits(hidden), F.linear(hidden, lm_head).float())
    head.set_target(embed, lambda h: torch.zeros(h.shape[0], VOCAB))
    assert torch.equal(head.logits(hidden), torch.zeros(3, VOCAB))
