"""What a draft model's drafter keeps between a draft and its verification (`Drafted`), and
the catch-up forward as chains (`as_chains`): spectral.speculative.drafters.draft_model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from spectral.core.forward import ForwardBatch, ForwardMode


def as_chains(batch: ForwardBatch) -> ForwardBatch:
    """`batch` (an extend) as the verification of one chain a request: each new token sees
    the ones before it (a causal mask), every row's logits; a decode step where each request
    has one new token."""
    if max(batch.extend_lens) == 1:
        return dataclasses.replace(batch, mode=ForwardMode.DECODE)
    masks = [torch.ones(n, n, dtype=torch.bool).tril().reshape(-1) for n in batch.extend_lens]
    mask = torch.cat(masks).to(batch.input_ids.device)
    return dataclasses.replace(
        batch, mode=ForwardMode.TARGET_VERIFY, custom_mask=mask, logits_rows="all"
    )


@dataclass
class Drafted:
    """What one draft computed for a request: its candidates (`tokens`, `parents`, in
    TreeExpansion.result's layout) and each level's frontier candidates [B, k], whose draft KV
    that level wrote: frontier node j of level d (row `b` of `frontiers[d - 1]`) in scratch
    row b * k + j, whose slot for level d is `scratch_slot0 + (b * k + j) * steps + d`."""

    b: int  # the request's place in its draft chunk
    steps: int
    tokens: torch.Tensor
    parents: torch.Tensor
    frontiers: list[torch.Tensor]

    def scratch_slots(self, path: list[int], scratch_slot0: int) -> list[int]:
        """The scratch slots holding the draft KV of the accepted `path`'s first tokens (below
        the root), as far as a level computed them."""
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        found: list[int] = []
        node = -1
        for depth, (token, frontier) in enumerate(zip(path, self.frontiers), start=1):
            nodes = frontier[self.b].tolist()
            k = len(nodes)
            j = next(
                (j for j, c in enumerate(nodes) if tokens[c] == token and parents[c] == node), None
            )
            if j is None:
                break
            node = nodes[j]
            found.append(scratch_slot0 + (self.b * k + j) * self.steps + depth)
        return found
