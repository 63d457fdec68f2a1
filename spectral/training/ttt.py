"""EAGLE-3's training-time test: the head unrolled over a batch as it runs in a draft tree.

Step s of the unrolled head feeds its own previous output back as the feature and predicts
s + 1 tokens further ahead; its queries see the real prefix (step 0's keys, causally) and, at
their own column, the keys of the earlier steps, which is the context a tree node has at
inference. Step losses are soft cross-entropies against the target, weighted 0.8^s.
"""

from __future__ import annotations

import torch

from spectral.speculative.drafters.eagle_head import DraftHead

STEP_WEIGHT = 0.8


class UnrolledAttention:
    """Attention of the unrolled steps over a [B, T] batch. Step 0 covers every column and is
    causal over itself (its keys are the real prefix). A later step covers columns
    `window..T-1` only (the anchors whose predictions reach the answers) and each of its
    queries sees the step-0 keys up to its own column plus, at that same column, the keys of
    steps 1..s (the draft's own earlier steps, as in a draft tree)."""

    def __init__(self, num_heads: int, scaling: float, pad: torch.Tensor, window: int) -> None:
        self.num_heads, self.scaling, self.window = num_heads, scaling, window
        B, T = pad.shape
        causal = torch.ones(T, T, dtype=torch.bool, device=pad.device).tril()
        self.mask0 = causal[None, None] & pad[:, None, None, :]
        self.B, self.T = B, T
        self.k0: torch.Tensor | None = None
        self.v0: torch.Tensor | None = None
        self.diag_k: list[torch.Tensor] = []
        self.diag_v: list[torch.Tensor] = []

    def _heads(self, x: torch.Tensor, cols: int) -> torch.Tensor:
        x = x.view(self.B, cols, x.shape[1], x.shape[2])
        return x.repeat_interleave(self.num_heads // x.shape[2], dim=2)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        first = self.k0 is None
        cols = self.T if first else self.T - self.window
        q = q.view(self.B, cols, q.shape[1], q.shape[2])
        k, v = self._heads(k, cols), self._heads(v, cols)
        if first:
            self.k0, self.v0 = k, v
            mask = self.mask0
        else:
            self.diag_k.append(k)
            self.diag_v.append(v)
            mask = self.mask0[:, :, self.window :]
        scores = torch.einsum("bthd,bshd->bhts", q, self.k0) * self.scaling
        scores = scores.masked_fill(~mask, float("-inf"))
        diag = [torch.einsum("bthd,bthd->bht", q, dk)[..., None] for dk in self.diag_k]
        all_scores = torch.cat([scores] + [d * self.scaling for d in diag], dim=-1)
        probs = torch.softmax(all_scores.float(), dim=-1).to(q.dtype)
        out = torch.einsum("bhts,bshd->bthd", probs[..., : self.T], self.v0)
        for j, dv in enumerate(self.diag_v):
            out = out + probs[..., self.T + j].transpose(1, 2)[..., None] * dv
        return out.reshape(self.B * cols, -1)


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, t + by] at column t (zeros past the end)."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - by] = x[:, by:]
    return out


def ttt_loss(
    head: DraftHead,
    input_ids: torch.Tensor,
    pad: torch.Tensor,
    loss_mask: torch.Tensor,
    features: torch.Tensor,
    teacher: torch.Tensor,
    steps: int,
    choice: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float], list[int]]:
    """(weighted loss over `steps` unrolled draft steps, per-step top-1 accuracy on the answer
    tokens, positions counted per step). `teacher` is the target's distribution over the draft
    vocabulary. Accuracy is agreement with `choice` [B, T] when given (the draft index of the
    target's top token over its whole vocabulary, -1 outside the draft vocabulary: what a
    verifier accepts), else with the teacher's top draft token.

    Anchor t at step s sees token t + 1 + s and predicts token t + 2 + s, whose teacher is the
    target's distribution at position t + 1 + s. Logits are computed only where a loss is."""
    B, T = input_ids.shape
    cfg = head.cfg
    answer_starts = [int(row.nonzero()[0]) for row in loss_mask if row.any()]
    window = max(0, min(answer_starts, default=0) - 1 - steps)
    attend = UnrolledAttention(cfg.num_heads, cfg.head_dim**-0.5, pad, window)
    hidden = features.reshape(B * T, -1)
    total = torch.zeros((), device=input_ids.device)
    accs: list[float] = []
    counts: list[int] = []
    for s in range(steps):
        shift = 1 + s
        if shift + 1 >= T:
            break
        first = 0 if s == 0 else window
        cols = T - first
        ids = _shift(input_ids, shift)[:, first:]
        positions = (
            (torch.arange(first, T, device=input_ids.device) + s).expand(B, cols).reshape(-1)
        )
        if s == 1:
            hidden = hidden.view(B, T, -1)[:, window:].reshape(B * cols, -1)
        hidden = head(ids.reshape(-1), hidden, positions, attend)
        mask = _shift(loss_mask, shift + 1)[:, first:].reshape(-1)
        target = _shift(teacher, shift)[:, first:].reshape(B * cols, -1)[mask]
        logits = head.logits(hidden[mask])
        if choice is None:
            best = target.argmax(-1)
        else:
            best = _shift(choice, shift)[:, first:].reshape(-1)[mask]
        p = torch.softmax(target, dim=-1)
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1)
        n = int(mask.sum())
        total = total + STEP_WEIGHT**s * ce.sum() / max(n, 1)
        with torch.no_grad():
            accs.append(float((logits.argmax(-1) == best).sum()) / max(n, 1))
        counts.append(n)
    return total, accs, counts
