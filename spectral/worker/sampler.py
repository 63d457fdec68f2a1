"""Turn logits into next tokens: penalties, temperature, top-k, top-p, min-p, seeded sampling.

Returned logprobs are those of the model's own distribution (log-softmax of the raw logits),
whatever the sampling parameters; they are what select-by-logprob and OpenAI `logprobs` expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from spectral import faults
from spectral.constrained import apply_bitmask
from spectral.core.transfer import on_device, to_device
from spectral.core.worker_io import RequestSampling


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None]


def apply_penalties(logits: torch.Tensor, sampling: list[RequestSampling]) -> torch.Tensor:
    """Repetition penalty over prompt + output (transformers' rule: divide positive logits,
    multiply negative ones); frequency and presence penalties over the output (OpenAI's rule);
    banned tokens get -inf. All rows at once: one copy of indices to the device however many
    rows have penalties; a copy of `logits` only where one applies."""
    banned: tuple[list[int], list[int]] = ([], [])
    seen: tuple[list[int], list[int], list[float]] = ([], [], [])
    counted: tuple[list[int], list[int]] = ([], [])
    frequency, presence = [0.0] * len(sampling), [0.0] * len(sampling)
    for row, s in enumerate(sampling):
        p = s.params
        banned[0].extend([row] * len(s.banned_token_ids))
        banned[1].extend(s.banned_token_ids)
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            ids = sorted(set(s.penalty_prompt_ids) | set(s.output_ids))
            seen[0].extend([row] * len(ids))
            seen[1].extend(ids)
            seen[2].extend([p.repetition_penalty] * len(ids))
        if s.output_ids and (p.frequency_penalty or p.presence_penalty):
            counted[0].extend([row] * len(s.output_ids))
            counted[1].extend(s.output_ids)
            frequency[row], presence[row] = p.frequency_penalty, p.presence_penalty
    if not (banned[0] or seen[0] or counted[0]):
        return logits
    out, device, vocab = logits.clone(), logits.device, logits.shape[-1]
    flat = out.view(-1)  # scatters and gathers over flat indices: none makes the host wait
    rows, tokens = banned[0] + seen[0] + counted[0], banned[1] + seen[1] + counted[1]
    index = on_device([r * vocab + t for r, t in zip(rows, tokens)], torch.long, device)
    a, b = len(banned[0]), len(banned[0]) + len(seen[0])
    if a:
        flat.index_fill_(0, index[:a], float("-inf"))
    if b > a:
        penalty = on_device(seen[2], out.dtype, device)
        vals = flat.gather(0, index[a:b])
        flat.scatter_(0, index[a:b], torch.where(vals > 0, vals / penalty, vals * penalty))
    if len(index) > b:
        counts = torch.zeros_like(out)
        ones = torch.ones(len(index) - b, dtype=out.dtype, device=device)
        counts.view(-1).scatter_add_(0, index[b:], ones)
        scales = on_device([frequency, presence], out.dtype, device)
        out -= scales[0][:, None] * counts + scales[1][:, None] * (counts > 0).to(out.dtype)
    return out


def filtered_probs(logits: torch.Tensor, sampling: list[RequestSampling]) -> torch.Tensor:
    """Softmax(logits / T) with top-k, top-p and min-p applied and renormalised, per row."""
    device = logits.device
    temps = on_device([max(s.params.temperature, 1e-6) for s in sampling], logits.dtype, device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    needs_filter = [
        s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in sampling
    ]
    if not any(needs_filter):
        return probs
    vocab = probs.shape[-1]
    limits = [s.params.top_k if s.params.top_k > 0 else vocab for s in sampling]
    top_p, min_p = on_device(
        [[s.params.top_p for s in sampling], [s.params.min_p for s in sampling]],
        probs.dtype,
        device,
    )
    # Only the candidates some row may keep are ranked: where every row has a top-k, the
    # largest of them (a partial sort), else the whole vocabulary; on a GPU, with no top-k,
    # nothing is sorted (thresholds found by bisection: a sort of the vocabulary there costs
    # more than the bisection's fixed steps, on a CPU less).
    width = max(limits)
    if width < vocab:
        sorted_probs, sorted_idx = probs.topk(width, dim=-1)
    elif probs.is_cuda:
        return threshold_filtered(probs, top_p, min_p)
    else:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    top_k = on_device(limits, torch.long, device)
    ranks = torch.arange(width, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p 1 keeps everything (a float32 running sum may reach 1 before the last tokens)
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


# Halvings of the top-p threshold's interval: below float32's resolution of a probability.
TOP_P_STEPS = 48


def threshold_filtered(
    probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Top-p and min-p without sorting the vocabulary: top-p keeps the tokens of probability
    at least t, t the largest threshold whose kept mass reaches top_p (what keeping the most
    likely tokens until their mass reaches top_p keeps, ties at t included), found by
    bisection between 0 and the row's largest probability; min-p keeps those at least min_p
    times it. No host read: the steps are fixed."""
    best = probs.max(dim=-1, keepdim=True).values
    low = torch.zeros_like(best)  # its kept mass always reaches top_p
    high = best.clone()
    target = top_p[:, None]
    for _ in range(TOP_P_STEPS):
        middle = (low + high) / 2
        reaches = (probs * (probs >= middle)).sum(dim=-1, keepdim=True) >= target
        low = torch.where(reaches, middle, low)
        high = torch.where(reaches, high, middle)
    # the largest probability whose kept mass still reaches top_p: `low` rounded up to it
    threshold = torch.where(probs >= low, probs, best).min(dim=-1, keepdim=True).values
    threshold = torch.where(target < 1.0, threshold, 0.0)  # top_p 1 keeps everything
    keep = (probs >= threshold) & (probs >= min_p[:, None] * best)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def argmax_rows(logits: torch.Tensor, kernels: ModuleType | None = None) -> torch.Tensor:
    """Each row's argmax, as torch.argmax gives it (the first of equal largest values, the first
    NaN): through spectral's CPU kernel where it takes the logits (float32 rows on the CPU: a
    few microseconds a row of a 49,152-token vocabulary, where torch takes ~63), else torch."""
    if (
        kernels is not None
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
    ):
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample_from_probs(
    probs: torch.Tensor, sampling: list[RequestSampling], kernels: ModuleType | None = None
) -> torch.Tensor:
    """One token per row by the exponential race argmax(p / E), E ~ Exp(1).

    A seeded request draws E from a CPU generator seeded by (seed, tokens generated so far), so
    its output depends neither on the batch it runs in nor on the device.
    """
    noise = torch.empty_like(probs).exponential_()
    seeded = [i for i, s in enumerate(sampling) if s.params.seed is not None]
    if seeded:
        draws = torch.empty((len(seeded), probs.shape[-1]), dtype=probs.dtype)
        for row, i in enumerate(seeded):
            s = sampling[i]
            gen = torch.Generator().manual_seed(request_step_seed(s.params.seed, len(s.output_ids)))
            draws[row].exponential_(generator=gen)
        index = on_device(seeded, torch.long, probs.device)
        noise.index_copy_(0, index, to_device(draws, probs.device))
    return argmax_rows(probs / noise, kernels)


def request_step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 12_345) % (2**63 - 1)


def sample(
    logits: torch.Tensor,
    sampling: list[RequestSampling],
    vocab_mask: torch.Tensor | None = None,
    kernels: ModuleType | None = None,
) -> SampleOutput:
    """logits: [B, vocab] float32, one row per request in `sampling`; `vocab_mask` (grammars'
    bitmasks) applies after the penalties, before temperature and the filters (through
    spectral's CPU `kernels` where given)."""
    for s in sampling:
        faults.inject("worker", s.rid)
    want_logprobs = any(s.return_logprob or s.top_logprobs_num for s in sampling)
    logprobs_all = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    adjusted = apply_penalties(logits, sampling)
    if vocab_mask is not None:
        adjusted = apply_bitmask(adjusted, vocab_mask, kernels)  # in place: logprobs are taken
    greedy = [s.params.is_greedy for s in sampling]
    next_ids = argmax_rows(adjusted, kernels)
    if not all(greedy):
        sub = [s for s, g in zip(sampling, greedy) if not g]
        rows = on_device([i for i, g in enumerate(greedy) if not g], torch.long, logits.device)
        probs = filtered_probs(adjusted.index_select(0, rows), sub)
        next_ids.index_copy_(0, rows, sample_from_probs(probs, sub, kernels))

    logprobs: list[float | None] = [None] * len(sampling)
    top: list[list[tuple[float, int]] | None] = [None] * len(sampling)
    if logprobs_all is not None:
        # Every row's chosen and top logprobs in one tensor, copied to the host once.
        k = max(s.top_logprobs_num for s in sampling)
        chosen = logprobs_all.gather(1, next_ids[:, None])
        parts = [chosen.double()]
        if k:
            vals, ids = logprobs_all.topk(k, dim=-1)
            parts += [vals.double(), ids.double()]
        host = torch.cat(parts, dim=1).tolist()
        for i, s in enumerate(sampling):
            if s.return_logprob:
                logprobs[i] = host[i][0]
            if s.top_logprobs_num:
                n = s.top_logprobs_num
                top[i] = [
                    (v, int(t)) for v, t in zip(host[i][1 : 1 + n], host[i][1 + k : 1 + k + n])
                ]
    return SampleOutput(next_ids, logprobs, top)
