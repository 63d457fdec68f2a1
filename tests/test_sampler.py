"""The sampler: greedy, the filters (checked by a chi-square test against the exact filtered
distribution), seeds, penalties (against transformers' logits processors) and banned tokens."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from spectral.core.worker_io import RequestSampling
from spectral.sampling_params import SamplingParams
from spectral.worker.sampler import apply_penalties, filtered_probs, sample, threshold_filtered

# Chi-square critical values at p = 0.001 for df 1..8.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def rs(**params) -> RequestSampling:
    return RequestSampling(SamplingParams(**params))


def draw(logits: torch.Tensor, sampling: RequestSampling, n: int) -> torch.Tensor:
    rows = logits.expand(n, -1).contiguous()
    return sample(rows, [sampling] * n).next_token_ids


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor, n: int) -> tuple[float, int]:
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "sampled a token the filter should have removed"
    exp = expected_probs[support] * n
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    return stat, int(support.sum()) - 1


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def exact(temperature=1.0, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The filtered distribution computed by hand, independently of the sampler's code."""
    p = torch.softmax(LOGITS / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, idx in enumerate(order.tolist()):
        ok = True
        if top_k is not None and rank >= top_k:
            ok = False
        if top_p is not None and mass >= top_p:
            ok = False
        if min_p is not None and p[idx] < min_p * p[order[0]]:
            ok = False
        keep[idx] = ok or rank == 0
        mass += float(p[idx])
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


@pytest.mark.parametrize(
    "params, probs",
    [
        (dict(temperature=1.0), exact()),
        (dict(temperature=0.7), exact(temperature=0.7)),
        (dict(temperature=1.0, top_k=3), exact(top_k=3)),
        (dict(temperature=1.0, top_p=0.8), exact(top_p=0.8)),
        (dict(temperature=1.3, min_p=0.2), exact(temperature=1.3, min_p=0.2)),
        (dict(temperature=0.9, top_k=5, top_p=0.9), exact(temperature=0.9, top_k=5, top_p=0.9)),
    ],
)
def test_sampled_frequencies_fit_the_filtered_distribution(params, probs):
    torch.manual_seed(1234)
    n = 20000
    tokens = draw(LOGITS[None, :], rs(**params), n)
    counts = torch.bincount(tokens, minlength=len(LOGITS)).float()
    stat, df = chi_square(counts, probs, n)
    assert stat < CHI2_CRIT[df], f"chi2 {stat:.1f} with {df} dof"


def test_filtered_probs_match_the_hand_computed_distribution():
    got = filtered_probs(LOGITS[None, :], [rs(temperature=0.9, top_k=5, top_p=0.9)])[0]
    assert torch.allclose(got, exact(temperature=0.9, top_k=5, top_p=0.9), atol=1e-6)


def test_greedy_is_argmax_and_temperature_zero_means_greedy():
    logits = torch.randn(4, 100)
    out = sample(logits, [rs(temperature=0.0)] * 2 + [rs(top_k=1)] * 2)
    assert out.next_token_ids.tolist() == logits.argmax(-1).tolist()


def test_a_seed_gives_the_same_tokens_in_any_batch():
    logits = torch.randn(1, 500)
    seeded = RequestSampling(SamplingParams(temperature=1.0, seed=7), output_ids=[1, 2, 3])
    alone = sample(logits, [seeded]).next_token_ids[0]
    batch = torch.cat([torch.randn(3, 500), logits])
    others = [rs(temperature=1.0)] * 3
    in_batch = sample(batch, others + [seeded]).next_token_ids[3]
    assert alone == in_batch
    later = RequestSampling(SamplingParams(temperature=1.0, seed=7), output_ids=[1, 2, 3, 4])
    draws = {int(sample(logits, [later]).next_token_ids[0]) for _ in range(3)}
    assert len(draws) == 1


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(1, 50)
    prompt, output = [3, 4, 5], [5, 9, 10]
    s = RequestSampling(
        SamplingParams(repetition_penalty=1.3), output_ids=output, penalty_prompt_ids=prompt
    )
    ours = apply_penalties(logits, [s])
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(ours, theirs)


def test_frequency_and_presence_penalties_follow_openai():
    logits = torch.zeros(1, 10)
    s = RequestSampling(
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), output_ids=[2, 2, 2, 7]
    )
    out = apply_penalties(logits, [s])[0]
    assert out[2].item() == pytest.approx(-(0.5 * 3 + 0.25))
    assert out[7].item() == pytest.approx(-(0.5 * 1 + 0.25))
    assert out[0].item() == 0.0


def test_banned_tokens_are_never_chosen():
    logits = torch.zeros(1, 5)
    logits[0, 2] = 10.0
    s = RequestSampling(SamplingParams(temperature=0.0), banned_token_ids=[2])
    assert sample(logits, [s]).next_token_ids[0] != 2


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    s = RequestSampling(SamplingParams(temperature=0.0), return_logprob=True, top_logprobs_num=2)
    out = sample(logits, [s])
    lse = math.log(sum(math.exp(x) for x in (1.0, 2.0, 3.0)))
    assert out.logprobs[0] == pytest.approx(3.0 - lse)
    assert [t for _, t in out.top_logprobs[0]] == [2, 1]
    assert out.top_logprobs[0][1][0] == pytest.approx(2.0 - lse)


def test_penalties_over_a_batch_equal_each_row_alone():
    """The batch's penalties (all rows' indices in one copy) give each row what it gets alone:
    banned tokens, repetition, frequency and presence penalties mixed over rows, some with none."""
    gen = torch.Generator().manual_seed(3)
    rows = [
        RequestSampling(
            SamplingParams(repetition_penalty=1.3), output_ids=[1, 4, 4], penalty_prompt_ids=[2, 3]
        ),
        RequestSampling(SamplingParams(), output_ids=[5, 6], banned_token_ids=[7, 8]),
        RequestSampling(
            SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=0.8),
            output_ids=[9, 9, 9, 1],
            penalty_prompt_ids=[0, 9],
            banned_token_ids=[1],
        ),
        RequestSampling(SamplingParams(presence_penalty=-0.5), output_ids=[11, 2, 11]),
    ]
    logits = torch.randn((len(rows), 12), generator=gen) * 3
    batch = apply_penalties(logits, rows)
    for i, s in enumerate(rows):
        assert torch.equal(batch[i], apply_penalties(logits[i : i + 1], [s])[0])
    assert not torch.equal(batch[:, :12], logits)
    plain = logits[:2]
    assert apply_penalties(plain, [rs(), rs()]) is plain  # no penalty: no copy


@pytest.mark.parametrize("seed", range(4))
def test_thresholds_keep_what_ranking_keeps(seed):
    """The GPU's sort-free top-p and min-p (`threshold_filtered`, run here on the CPU) keep
    the tokens, and give the distribution, of ranking the vocabulary (the CPU's way), for
    sharp and flat rows and every kind of filter."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((6, 5000), generator=gen) * torch.tensor([[0.5], [2], [4], [8], [1], [3]])
    params = [
        dict(top_p=0.9),
        dict(top_p=0.5),
        dict(top_p=0.99, min_p=0.05),
        dict(top_p=0.3),
        dict(min_p=0.2),
        dict(top_p=1.0),
    ]
    sampling = [rs(temperature=1.0, **p) for p in params]
    ranked = filtered_probs(logits, sampling)
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([p.get("top_p", 1.0) for p in params])
    min_p = torch.tensor([p.get("min_p", 0.0) for p in params])
    got = threshold_filtered(probs, top_p, min_p)
    assert torch.equal(got > 0, ranked > 0)
    assert torch.allclose(got, ranked, atol=1e-6)
