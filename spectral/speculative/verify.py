"""Verification of draft trees against the target's outputs at every node.

The target ran once over each tree's n nodes under the tree mask: its row j is the next-token
distribution after the root-to-j path. Verification walks each tree from the root, accepting
at most one child per level, and ends with one token of the target's own (the correction, or a
bonus at a leaf), so a request always emits len(accepted) tokens, at least one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spectral.speculative.tree import DraftTrees


@dataclass
class VerifyResult:
    """Per request: the accepted node indices, root first (always starts with 0), and the
    tokens to append: those of accepted[1:], then the bonus/correction token."""

    accepted: list[list[int]]
    emitted: list[list[int]]
    # per request, the target's greedy choice after each node (where the verifier reports it)
    node_next: list[list[int]] = field(default_factory=list)


def verify_greedy(trees: DraftTrees, target_ids: torch.Tensor | list[list[int]]) -> VerifyResult:
    """Accept the path the target's argmax follows. `target_ids` [B, n] (a tensor, or a list
    of a list a request, each at least as long as its tree): the target's argmax after each
    node (padding entries are ignored). At each node the child whose token equals the target's
    choice there is accepted (the first such child in sibling order); the walk stops when
    there is none and emits the target's choice at the last accepted node."""
    B = trees.tokens.shape[0]
    if isinstance(target_ids, list):
        if len(target_ids) != B:
            raise ValueError(f"target_ids must have one row a tree, {B} (got {len(target_ids)})")
        all_ids = target_ids
    elif target_ids.shape != trees.tokens.shape:
        raise ValueError(
            f"target_ids must be [B, n] = {tuple(trees.tokens.shape)} "
            f"(got {tuple(target_ids.shape)})"
        )
    else:
        all_ids = target_ids.cpu().tolist()
    all_tokens = trees.tokens.tolist()
    all_first = trees.next_token.tolist()
    all_sibling = trees.next_sibling.tolist()
    accepted: list[list[int]] = []
    emitted: list[list[int]] = []
    for tokens, first, sibling, ids in zip(all_tokens, all_first, all_sibling, all_ids):
        path, out, cur = [0], [], 0
        while True:
            child = first[cur]
            while child != -1 and tokens[child] != ids[cur]:
                child = sibling[child]
            if child == -1:
                break
            path.append(child)
            out.append(tokens[child])
            cur = child
        out.append(ids[cur])
        accepted.append(path)
        emitted.append(out)
    return VerifyResult(accepted, emitted)


def accept_greedy_on_device(trees: DraftTrees, target_ids: torch.Tensor) -> torch.Tensor:
    """`verify_greedy`'s walk where the trees and `target_ids` are, reading nothing on the
    host: a node is chosen where it is the first child (in node order, which is sibling order)
    whose token is the target's choice at its parent, and accepted where it and every ancestor
    below the root are chosen. Returns [B, 1 + 2n] int64: the accepted count, the accepted
    nodes by depth (root first, then -1), and the tokens emitted after each (then -1: the
    target's choice at each accepted node, which is the next accepted node's token and, at
    the last, the correction or bonus)."""
    tokens, parents = trees.tokens, trees.parents
    B, n = tokens.shape
    index = torch.arange(n, device=tokens.device).expand(B, n)
    parent = parents.clamp(min=0)
    match = (parents >= 0) & (tokens == target_ids.gather(1, parent))
    none = torch.full_like(index, n)
    first = none.scatter_reduce(1, parent, torch.where(match, index, n), reduce="amin")
    chosen = match & (first.gather(1, parent) == index)
    ok = chosen | (index == 0)  # the root needs no choosing
    accepted = ~(trees.mask & ~ok[:, None, :]).any(dim=-1)
    count = accepted.sum(dim=1, keepdim=True)
    path = torch.full((B, n + 1), -1, dtype=torch.int64, device=tokens.device)
    path.scatter_(1, torch.where(accepted, trees.depths, n), index)  # one node a depth
    path = path[:, :n]
    emitted = torch.where(path >= 0, target_ids.gather(1, path.clamp(min=0)), -1)
    return torch.cat((count, path, emitted), dim=1)


def packed_round(trees: DraftTrees, target_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """What a greedy round on the device gives the host in one copy, [B, 1 + 2n + n + C]
    float64: `accept_greedy_on_device`'s verdict, the trees' node ranks and the candidates'
    `scores` [B, C]."""
    packed = accept_greedy_on_device(trees, target_ids)
    return torch.cat((packed.double(), trees.ranks.double(), scores.double()), 1)


def unpack_accepted(packed: list[list[int]]) -> VerifyResult:
    """`accept_greedy_on_device`'s rows (on the host) as a VerifyResult."""
    n = (len(packed[0]) - 1) // 2 if packed else 0
    accepted = [row[1 : 1 + row[0]] for row in packed]
    emitted = [row[1 + n : 1 + n + row[0]] for row in packed]
    return VerifyResult(accepted, emitted)


def verify_sampling(
    trees: DraftTrees,
    probs: torch.Tensor,
    generator: torch.Generator | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> VerifyResult:
    """Accept a path by the lossless rule for deterministic (top-k) drafts (docs/speculative.md):
    the emitted tokens follow the target's distributions exactly, as if sampled one at a time.

    `probs` [B, n, V] (CPU): the target's distribution at every node after temperature, top-k
    and top-p, with positive mass wherever the walk can reach (not necessarily normalised).
    Request b draws from `generators[b]` where given, else from `generator`; its own generator
    is consumed the same whatever the batch, so its result never depends on other requests.
    """
    B, n = trees.tokens.shape
    if probs.dim() != 3 or probs.shape[:2] != (B, n):
        raise ValueError(f"probs must be [B, n, V] with B, n = {B}, {n} (got {tuple(probs.shape)})")
    if generators is not None and len(generators) != B:
        raise ValueError(f"generators must have one entry per request ({B}, got {len(generators)})")
    own = [(b, g) for b, g in enumerate(generators or []) if g is not None]
    uses_own = torch.zeros(B, dtype=torch.bool)
    uses_own[[b for b, _ in own]] = True
    shared = torch.arange(B)[~uses_own]
    uniforms = _uniforms(B, max(n - 1, 1), shared, own, generator)
    path, path_len, residual = _walk(trees, probs, uniforms)
    if (residual.sum(dim=-1) <= 0).any():
        raise ValueError("probs has a row without mass at a node the walk reached")
    final = torch.empty(B, dtype=torch.int64)
    if shared.numel():
        final[shared] = torch.multinomial(residual[shared], 1, generator=generator)[:, 0]
    for b, g in own:
        final[b] = torch.multinomial(residual[b], 1, generator=g)[0]
    return _path_result(trees, path, path_len, final)


def _uniforms(
    B: int,
    width: int,
    shared: torch.Tensor,
    own: list[tuple[int, torch.Generator]],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """[B, width] float64 uniforms: the rows `shared` from `generator` in one draw, then each
    request of `own` (index, generator) from its own generator."""
    uniforms = torch.empty((B, width), dtype=torch.float64)
    uniforms[shared] = torch.rand((shared.numel(), width), dtype=torch.float64, generator=generator)
    for b, g in own:
        uniforms[b] = torch.rand(width, dtype=torch.float64, generator=g)
    return uniforms


def _walk(
    trees: DraftTrees, probs: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk every tree from the root, testing children in sibling order with `uniforms` (one a
    test, in order): an accepted child moves the walk to its distribution, a rejected one's
    token leaves the residual. Returns (path [B, n] padded with -1, its lengths [B], the
    residual distribution [B, V] the last token is drawn from)."""
    B, n = trees.tokens.shape
    batch = torch.arange(B)
    child = trees.next_token[:, 0].clone()
    draws = torch.zeros(B, dtype=torch.int64)  # uniforms used so far
    path = torch.full((B, n), -1, dtype=torch.int64)
    path[:, 0] = 0
    path_len = torch.ones(B, dtype=torch.int64)
    residual = probs[:, 0].to(torch.promote_types(probs.dtype, torch.float32)).clone()
    # Each pass tests one child per request still walking; a node is tested at most once, so
    # no request makes more than n - 1 tests.
    while True:
        rows = batch[child >= 0]
        if rows.numel() == 0:
            break
        node = child[rows]
        token = trees.tokens[rows, node]
        p_token = residual[rows, token].double()
        total = residual[rows].sum(dim=-1, dtype=torch.float64)
        u = uniforms[rows, draws[rows]]
        draws[rows] += 1
        # Accept with probability p[x] / total; if x holds all the mass, always accept.
        accept = (u * total < p_token) | ((total - p_token <= 0) & (total > 0))

        up = rows[accept]
        up_node = node[accept]
        path[up, path_len[up]] = up_node
        path_len[up] += 1
        residual[up] = probs[up, up_node].to(residual.dtype)
        child[up] = trees.next_token[up, up_node]

        down = rows[~accept]
        residual[down, token[~accept]] = 0
        child[down] = trees.next_sibling[down, node[~accept]]
    return path, path_len, residual


def _path_result(
    trees: DraftTrees, path: torch.Tensor, path_len: torch.Tensor, final: torch.Tensor
) -> VerifyResult:
    """The accepted paths (`path` [B, n] cut to `path_len`) and their emitted tokens: the
    drafted tokens after the root, then each request's `final` token."""
    B = path.shape[0]
    longest = int(path_len.max()) if B else 0
    path = path[:, :longest]
    path_tokens = trees.tokens.gather(1, path.clamp(min=0))
    accepted: list[list[int]] = []
    emitted: list[list[int]] = []
    for nodes, toks, length, last in zip(
        path.tolist(), path_tokens.tolist(), path_len.tolist(), final.tolist()
    ):
        accepted.append(nodes[:length])
        emitted.append(toks[1:length] + [last])
    return VerifyResult(accepted, emitted)
