"""Batches of samples: length buckets within a token budget, padded into tensors."""

from __future__ import annotations

import random

import torch

from spectral.training.train_data import Sample


def batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[Sample]]:
    """Length-bucketed batches of at most `batch_tokens` padded tokens, in random order."""
    order = sorted(samples, key=lambda s: len(s.input_ids))
    out: list[list[Sample]] = []
    current: list[Sample] = []
    for s in order:
        if current and (len(current) + 1) * len(s.input_ids) > batch_tokens:
            out.append(current)
            current = []
        current.append(s)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def collate(
    batch: list[Sample], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, which are not padding, which are answer tokens), [B, T] on `device`."""
    T = max(len(s.input_ids) for s in batch)
    ids = torch.zeros((len(batch), T), dtype=torch.int64)
    pad = torch.zeros((len(batch), T), dtype=torch.bool)
    mask = torch.zeros((len(batch), T), dtype=torch.bool)
    for i, s in enumerate(batch):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        pad[i, :n] = True
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
    return ids.to(device), pad.to(device), mask.to(device)
