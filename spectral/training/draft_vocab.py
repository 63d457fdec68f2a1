"""The draft vocabulary: which target tokens the head predicts (`d2t`/`t2d`), chosen from the
answers' most frequent tokens, and a head's output rows moved to a new one."""

from __future__ import annotations

from collections import Counter

import torch

from spectral.training.train_data import Sample


def index_of(ids: torch.Tensor, size: int) -> torch.Tensor:
    """[size]: the position of each id in `ids`, -1 for ids it lacks (e.g. target token ->
    draft index)."""
    where = torch.full((size,), -1, dtype=torch.int64, device=ids.device)
    where[ids] = torch.arange(ids.numel(), device=ids.device)
    return where


def draft_vocabulary(
    samples: list[Sample], size: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the `size` most frequent answer tokens, in ascending id order."""
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(t for t, m in zip(s.input_ids, s.loss_mask) if m)
    top = [t for t, _ in counts.most_common(size)]
    if len(top) < size:  # small data: fill with the lowest unused ids
        taken = set(top)
        top += [t for t in range(vocab_size) if t not in taken][: size - len(top)]
    used = torch.tensor(sorted(top), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(size), t2d


def vocabulary_coverage(samples: list[Sample], t2d: torch.Tensor) -> float:
    """Share of the answer tokens that the draft vocabulary `t2d` holds."""
    answer = [t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m]
    if not answer:
        return 0.0
    return float(t2d[torch.tensor(answer)].float().mean())


def remap_output_rows(
    rows: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor, target_out: torch.Tensor
) -> torch.Tensor:
    """A head's output rows for the draft vocabulary `new_ids` (target token ids) from its
    `rows` for `old_ids`: a token it has keeps its row; a new token gets the target's output
    row for it, mapped into the head's space by the least-squares fit of the head's rows on the
    target's rows for `old_ids` (the head learns to predict what the target's final state
    predicts, so the two sets of rows are close to linearly related)."""
    rows = rows.detach().float()
    target_out = target_out.detach().float()
    fit = torch.linalg.lstsq(target_out[old_ids], rows).solution
    out = target_out[new_ids] @ fit
    where = index_of(old_ids, target_out.shape[0])[new_ids]
    have = where >= 0
    out[have] = rows[where[have]]
    return out
