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
from spectral.core.worker_io import RequestSampling


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None]


def apply_penalties(logits: torch.Tensor, sampling: list[RequestSampling]) -> torch.Tensor:
    """Repetition penalty over prompt + output (transformers' rule: divide positive logits,
    multiply negative ones); frequency and presence penalties over the output (OpenAI's rule);
    banned tokens get -inf."""
    out = logits
    for row, s in enumerate(sampling):
        p = s.params
        if s.banned_token_ids:
            if out is logits:
                out = logits.clone()
            out[row, s.banned_token_ids] = float("-inf")
        if not p.has_penalties:
            continue
        if out is logits:
            out = logits.clone()
        vocab = logits.shape[-1]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(s.penalty_prompt_ids) | set(s.output_ids)),
                dtype=torch.long,
                device=out.device,
            )
            if seen.numel():
                vals = out[row, seen]
                out[row, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if s.output_ids and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(s.output_ids, dtype=torch.long, device=out.device)
            counts = torch.bincount(ids, minlength=vocab)
            counts = counts.to(out.dtype)
            out[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                out.dtype
            )
    return out


def filtered_probs(logits: torch.Tensor, sampling: list[RequestSampling]) -> torch.Tensor:
    """Softmax(logits / T) with top-k, top-p and min-p applied and renormalised, per row."""
    device = logits.device
    temps = torch.tensor(
        [max(s.params.temperature, 1e-6) for s in sampling], dtype=logits.dtype, device=device
    )
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    needs_filter = [
        s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in sampling
    ]
    if not any(needs_filter):
        return probs
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    top_k = torch.tensor(
        [s.params.top_k if s.params.top_k > 0 else vocab for s in sampling], device=device
    )
    top_p = torch.tensor([s.params.top_p for s in sampling], dtype=probs.dtype, device=device)
    min_p = torch.tensor([s.params.min_p for s in sampling], dtype=probs.dtype, device=device)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p[:, None]
    drop |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, sampling: list[RequestSampling]) -> torch.Tensor:
    """One token per row by the exponential race argmax(p / E), E ~ Exp(1).

    A seeded request draws E from a CPU generator seeded by (seed, tokens generated so far), so
    its output depends neither on the batch it runs in nor on the device.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, s in enumerate(sampling) if s.params.seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(
            (len(unseeded), probs.shape[-1]), dtype=probs.dtype, device=probs.device
        ).exponential_()
    seeded = [i for i, s in enumerate(sampling) if s.params.seed is not None]
    if seeded:
        draws = torch.empty((len(seeded), probs.shape[-1]), dtype=probs.dtype)
        for row, i in enumerate(seeded):
            s = sampling[i]
            gen = torch.Generator().manual_seed(request_step_seed(s.params.seed, len(s.output_ids)))
            draws[row].exponential_(generator=gen)
        noise[seeded] = draws.to(probs.device)
    return (probs / noise).argmax(dim=-1)


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
    next_ids = adjusted.argmax(dim=-1)
    if not all(greedy):
        rows = [i for i, g in enumerate(greedy) if not g]
        sub = [sampling[i] for i in rows]
        next_ids[rows] = sample_from_probs(filtered_probs(adjusted[rows], sub), sub)

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
