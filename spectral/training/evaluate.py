"""Scoring a head on held-out samples: per-step agreement with the target as a verifier would
accept it, and the τ of a one-path draft with that agreement."""

from __future__ import annotations

import random

import torch

from spectral.speculative.drafters.eagle_head import DraftHead
from spectral.training.batching import batches, collate
from spectral.training.draft_vocab import index_of
from spectral.training.teacher import TeacherCache
from spectral.training.train_data import Sample
from spectral.training.ttt import ttt_loss


@torch.no_grad()
def evaluate(
    head: DraftHead,
    teacher: TeacherCache,
    samples: list[Sample],
    used: torch.Tensor,
    steps: int,
    batch_tokens: int,
) -> list[float]:
    """Per-step top-1 agreement with the target on every answer token of `samples` (the
    training-time test, in eval mode). A step counts only when the head picks the target's top
    token over its whole vocabulary, so a token outside the draft vocabulary is a miss."""
    hits = [0.0] * steps
    counts = [0] * steps
    draft_index = index_of(used, head.cfg.vocab_size)
    was_training = head.training
    head.eval()
    for batch in batches(samples, batch_tokens, random.Random(0)):
        ids, pad, mask = collate(batch, used.device)
        features, last = teacher.states(batch, ids, pad)
        logits = teacher.teacher.logits(last, used)
        choice = draft_index[teacher.top_tokens(batch, last)]
        _, accs, ns = ttt_loss(head, ids, pad, mask, features, logits, steps, choice)
        for s, (a, n) in enumerate(zip(accs, ns)):
            hits[s] += a * n
            counts[s] += n
    head.train(was_training)
    return [h / max(n, 1) for h, n in zip(hits, counts)]


def chain_accept_length(accs: list[float]) -> float:
    """τ of a one-path draft whose steps agree with the target with these probabilities,
    taken as independent: 1 + a0 + a0·a1 + ..."""
    tau, reach = 1.0, 1.0
    for a in accs:
        reach *= a
        tau += reach
    return tau
