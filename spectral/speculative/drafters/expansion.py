"""EAGLE-2's expansion of draft trees level by level, the part every drafter shares.

A drafter gives the first level (the top-k after each request's root) and then, level after
level, the next-token log-probabilities of the current frontier (k nodes a request); each
frontier node's top-k children are scored by cumulative log-probability and the best k of the
k x k become the next frontier. What the drafter runs between levels (a head over hidden
states, a draft LM over its KV) is its own; the candidates come out in the layout
`select_eagle_trees` takes: level by level, parents before their children.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class TreeExpansion:
    def __init__(self, scores: torch.Tensor, tokens: torch.Tensor) -> None:
        """`scores` [B, k]: log-probabilities of the root's top-k children, `tokens` [B, k]
        their (target) token ids."""
        B, k = scores.shape
        self.k = k
        self.scores = [scores]
        self.tokens = [tokens]
        self.parents = [torch.full((B, k), -1, dtype=torch.int64, device=scores.device)]
        self.frontier_tokens = tokens
        self.frontier_scores = scores
        self._frontier_ids = torch.arange(k, device=scores.device).expand(B, k)
        self._base = k
        self._children: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def frontier_ids(self) -> torch.Tensor:
        """[B, k] the candidate index (in `result`'s layout) of each frontier node."""
        return self._frontier_ids

    @property
    def batch_size(self) -> int:
        return self.frontier_tokens.shape[0]

    def add_level(
        self,
        logprobs: torch.Tensor,
        to_target_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Append the frontier's children: `logprobs` [B * k, V] after each frontier node (in
        frontier order); `to_target_ids` maps the drafter's ids to the target's."""
        child_lp, child_ids = logprobs.topk(self.k, dim=-1)
        if to_target_ids is not None:
            child_ids = to_target_ids(child_ids)
        self.add_children(child_lp, child_ids)

    def add_children(self, child_lp: torch.Tensor, child_ids: torch.Tensor) -> None:
        """Append the frontier's children given as each frontier node's top-k: log-probs and
        target ids, [B * k, k] in frontier order (or [B, k]: the same children under every
        frontier node of a request)."""
        B, k = self.batch_size, self.k
        if child_lp.shape[0] == B and k > 1:
            child_lp = child_lp.repeat_interleave(k, dim=0)
            child_ids = child_ids.repeat_interleave(k, dim=0)
        child_ids = child_ids.reshape(B, k * k)
        cumulative = (child_lp.view(B, k, k) + self.frontier_scores[:, :, None]).view(B, k * k)
        self.scores.append(cumulative)
        self.tokens.append(child_ids)
        self.parents.append(self._frontier_ids[:, :, None].expand(B, k, k).reshape(B, k * k))
        self._children = (cumulative, child_ids)

    def advance(self) -> torch.Tensor:
        """Make the best k children of the last level the frontier; returns [B, k] the index,
        in the old frontier, of each new frontier node's parent."""
        assert self._children is not None, "add_level first"
        cumulative, child_ids = self._children
        k = self.k
        chosen = cumulative.topk(k, dim=-1).indices
        self.frontier_tokens = child_ids.gather(1, chosen)
        self.frontier_scores = cumulative.gather(1, chosen)
        self._frontier_ids = self._base + chosen
        self._base += k * k
        return chosen // k

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cumulative log-prob, target token, parent candidate or -1 under the root), each
        [B, C] with C = k + (levels - 1) k²."""
        return torch.cat(self.scores, 1), torch.cat(self.tokens, 1), torch.cat(self.parents, 1)
