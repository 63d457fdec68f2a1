"""EAGLE-2 draft trees: a batch of token trees laid out for one target forward (tree verify).

Every tree has `n` node slots (`num_draft_tokens`, root included). Node 0 is the root, the
request's last verified token; every other real node comes after its parent, so any prefix of
the node list is a tree. Nodes from `num_nodes[b]` on are padding (token 0, parent -1, depth 0,
only the diagonal in the mask, nobody's child or sibling). Trees live on the CPU, except
those `select_eagle_trees(..., on_device=True)` builds where its inputs are (a round that reads
nothing on the host before its result).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spectral.core.transfer import on_device as to_device_list


@dataclass
class DraftTrees:
    """A batch of B token trees of n nodes each (n = num_draft_tokens, root included)."""

    tokens: torch.Tensor  # [B, n] int64; tokens[:, 0] are the root tokens
    parents: torch.Tensor  # [B, n] int64; parent node, -1 for the root and padding; < own index
    depths: torch.Tensor  # [B, n] int64; number of ancestors (0 for the root and padding)
    mask: torch.Tensor  # [B, n, n] bool; mask[b, i, j]: j is i or an ancestor of i
    next_token: torch.Tensor  # [B, n] int64; first (lowest-index) child, or -1
    next_sibling: torch.Tensor  # [B, n] int64; next higher-index node with the same parent, or -1
    num_nodes: list[int]  # real nodes per tree (root included, <= n)
    # [B, n] int64: each non-root node's rank in its tree by the drafter's confidence (0 the
    # best; the best r nodes form a tree); -1 for the root and padding
    ranks: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_draft_tokens(self) -> int:
        return self.tokens.shape[1]


def _assemble(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: list[int],
    ranks: torch.Tensor | None = None,
) -> DraftTrees:
    """Derive depths, mask and the child/sibling links from `parents` [B, n], which must
    already satisfy the layout (parents[b, j] < j for real nodes, -1 for root and padding).
    Without `ranks`, nodes rank in their order."""
    B, n = parents.shape
    device = parents.device
    batch = torch.arange(B, device=device)
    index = torch.arange(n, device=device)
    # each node sees itself (an eye made where the trees are: setting the diagonal by index
    # would copy the value True from the host, which waits for the device)
    mask = torch.eye(n, dtype=torch.bool, device=device).expand(B, n, n).clone()
    for j in range(1, n):
        parent = parents[:, j]
        has_parent = parent >= 0
        mask[:, j] |= mask[batch, parent.clamp(min=0)] & has_parent[:, None]
    depths = mask.sum(dim=-1) - 1

    no_node = torch.full((), n, dtype=torch.int64, device=device)
    # is_child[b, i, j]: j is a child of i.
    is_child = parents[:, None, :] == index[None, :, None]
    first_child = torch.where(is_child, index, no_node).min(dim=-1).values
    # later_sibling[b, i, j]: j > i shares i's (real) parent.
    later_sibling = (
        (parents[:, :, None] == parents[:, None, :])
        & (parents[:, :, None] >= 0)
        & (index[None, :] > index[:, None])
    )
    sibling = torch.where(later_sibling, index, no_node).min(dim=-1).values
    if ranks is None:
        real = index[None, :] < to_device_list(num_nodes, torch.int64, device)[:, None]
        ranks = torch.where(real & (index[None, :] > 0), index[None, :] - 1, -1)
    return DraftTrees(
        tokens=tokens,
        parents=parents,
        depths=depths,
        mask=mask,
        next_token=torch.where(first_child == n, -1, first_child),
        next_sibling=torch.where(sibling == n, -1, sibling),
        num_nodes=num_nodes,
        ranks=ranks,
    )


def trees_from_parents(
    root_tokens: list[int],
    node_tokens: list[list[int]],
    node_parents: list[list[int]],
    n: int,
) -> DraftTrees:
    """Trees given node by node (the n-gram drafter's form), padded to n nodes:
    `node_tokens[b]` are request b's non-root nodes in order, `node_parents[b][i]` the parent
    of non-root node i in the full node list (0 the root, i + 1 non-root node i), so in 0..i.
    ValueError on a parent after its child or on a tree of more than n nodes."""
    if n < 1:
        raise ValueError(f"num_draft_tokens must be >= 1 (got {n})")
    B = len(root_tokens)
    if len(node_tokens) != B or len(node_parents) != B:
        raise ValueError(
            f"root_tokens, node_tokens and node_parents must have one entry per request "
            f"(got {B}, {len(node_tokens)} and {len(node_parents)})"
        )
    for b, (toks, pars) in enumerate(zip(node_tokens, node_parents)):
        if len(toks) != len(pars):
            raise ValueError(f"request {b}: {len(toks)} node tokens but {len(pars)} node parents")
        if len(toks) > n - 1:
            raise ValueError(
                f"request {b}: a tree of {len(toks)} non-root nodes does not fit in "
                f"num_draft_tokens={n} (at most {n - 1} besides the root)"
            )
        for i, parent in enumerate(pars):
            if not 0 <= parent <= i:
                raise ValueError(
                    f"request {b}: the parent of node {i + 1} must be an earlier node in "
                    f"0..{i} (got {parent})"
                )
    return _assemble_lists(root_tokens, node_tokens, node_parents, n)


def _assemble_lists(
    root_tokens: list[int], node_tokens: list[list[int]], node_parents: list[list[int]], n: int
) -> DraftTrees:
    """`_assemble` for trees given as host lists (checked): walked node by node in Python, one
    array a field, where `_assemble`'s tensor operations (a few dozen, one pass a node for
    the mask) cost a round on the CPU more than the walk (~0.4 ms for a tree of 16 nodes)."""
    B = len(root_tokens)
    fields = np.full((6, B, n), -1, dtype=np.int64)  # tokens parents depths first sibling ranks
    fields[[0, 2]] = 0
    mask = np.zeros((B, n * n), dtype=bool)
    mask[:, :: n + 1] = True  # each node sees itself (padding included)
    num_nodes: list[int] = []
    for b, (root, toks, pars) in enumerate(zip(root_tokens, node_tokens, node_parents)):
        m = len(toks) + 1
        ancestors: list[list[int]] = [[]]  # each node's, itself excluded
        first, sibling = fields[3, b], fields[4, b]
        last_child = [-1] * m
        for j, parent in enumerate(pars, start=1):
            ancestors.append(ancestors[parent] + [parent])
            if last_child[parent] < 0:
                first[parent] = j
            else:
                sibling[last_child[parent]] = j
            last_child[parent] = j
        fields[0, b, 0] = int(root)
        fields[0, b, 1:m] = toks
        fields[1, b, 1:m] = pars
        fields[2, b, :m] = [len(a) for a in ancestors]
        fields[5, b, 1:m] = range(m - 1)
        mask[b, [j * n + a for j in range(1, m) for a in ancestors[j]]] = True
        num_nodes.append(m)
    # one tensor an array (NumPy's views are cheaper than torch's selects of one tensor)
    tokens, parents, depths, first, sibling, ranks = (torch.from_numpy(f) for f in fields)
    return DraftTrees(
        tokens=tokens,
        parents=parents,
        depths=depths,
        mask=torch.from_numpy(mask.reshape(B, n, n)),
        next_token=first,
        next_sibling=sibling,
        num_nodes=num_nodes,
        ranks=ranks,
    )


def merge_tree_nodes(
    base_tokens: list[int],
    base_parents: list[int],
    extra_tokens: list[int],
    extra_parents: list[int],
) -> tuple[list[int], list[int]]:
    """Union of two trees under the same root, in `trees_from_parents`' node form (parent 0 is
    the root, i + 1 is non-root node i). The base's nodes keep their places; an extra node
    whose path the merged tree already holds maps onto that node, any other is appended after
    the base's. Parents still come before children, so any prefix of the result is a tree."""
    tokens, parents = list(base_tokens), list(base_parents)
    node_of: dict[tuple[int, ...], int] = {(): 0}  # token path from the root -> first node
    base_paths: list[tuple[int, ...]] = [()]
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        base_paths.append(base_paths[parent] + (token,))
        node_of.setdefault(base_paths[-1], i + 1)
    extra_paths: list[tuple[int, ...]] = [()]
    for token, parent in zip(extra_tokens, extra_parents):
        path = extra_paths[parent] + (token,)
        extra_paths.append(path)
        if path not in node_of:
            tokens.append(token)
            parents.append(node_of[path[:-1]])
            node_of[path] = len(tokens)
    return tokens, parents


def select_eagle_trees(
    root_tokens: torch.Tensor,
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parent_candidates: torch.Tensor,
    n: int | list[int],
    on_device: bool = False,
) -> DraftTrees:
    """EAGLE-2 rerank: keep each request's n - 1 best draft candidates as a tree (`n` one size
    for all, or one per request; padded to the largest; on the CPU whatever the inputs' device,
    or with `on_device` where the scores are, reading nothing on the host: the candidates are
    not checked, and `num_nodes` counts every picked candidate, which is exact where a child
    never outscores its parent, as with cumulative log-probabilities).

    `scores`, `tokens`, `parent_candidates` [B, C]: cumulative log-prob, token, and parent
    candidate (-1 under the root; always a lower index). NaN counts as -inf and ties go to the
    lower index, so a parent is picked before an equal child. Picked candidates keep their order
    and rank by score; one whose parent was not picked is dropped with its descendants.
    """
    sizes = [n] * scores.shape[0] if isinstance(n, int) else list(n)
    device = scores.device if on_device else torch.device("cpu")
    root_tokens, scores, tokens, parent_candidates = (
        root_tokens.to(device, torch.int64),
        scores.detach().float().to(device),
        tokens.to(device, torch.int64),
        parent_candidates.to(device, torch.int64),
    )
    _check_candidates(scores, tokens, parent_candidates, sizes, checked_values=not on_device)
    counts = candidates_kept(sizes, scores.shape[1])
    wanted = to_device_list(counts, torch.int64, device)
    trees = select_trees_static(
        root_tokens, scores, tokens, parent_candidates, wanted, max(counts), max(sizes)
    )
    if on_device:
        trees.num_nodes = [1 + count for count in counts]
    else:  # the survivors: every node with a parent
        trees.num_nodes = (1 + (trees.parents >= 0).sum(dim=1)).tolist()
    return trees


def candidates_kept(sizes: list[int], candidates: int) -> list[int]:
    """The candidates a tree of each size keeps besides its root (at most `candidates`): each
    tree's `num_nodes` less one where the selection runs on the device."""
    return [min(size - 1, candidates) for size in sizes]


def select_trees_static(
    root_tokens: torch.Tensor,
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parent_candidates: torch.Tensor,
    wanted: torch.Tensor,
    m: int,
    width: int,
) -> DraftTrees:
    """`select_eagle_trees(..., on_device=True)` from inputs already where they belong (int64
    and float32 on one device), each request's count of wanted candidates on the device
    (`wanted` [B], each at most `m`; `width` the trees' node slots): nothing read on the
    host, no host value copied, so a CUDA graph can hold it. `num_nodes` is left empty (the
    caller knows the counts)."""
    B, C = scores.shape
    device = scores.device
    own = torch.arange(C, device=device)
    scores = torch.where(scores.isnan(), float("-inf"), scores)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank_of = torch.empty_like(order)
    rank_of.scatter_(1, order, own.expand(B, C).contiguous())
    # Each request's best wanted[b] candidates in candidate order; C marks an empty place.
    places = torch.arange(m + 1, device=device)
    top = torch.where(places[None, :m] < wanted[:, None], order[:, :m], C)
    picked = top.sort(dim=1).values  # [B, m]
    real = picked < C
    # tree row of each picked candidate
    row_of = torch.full((B, C + 1), -1, dtype=torch.int64, device=device)
    row_of.scatter_(1, picked, places[None, 1:].expand(B, m).contiguous())
    parent_cand = parent_candidates.gather(1, picked.clamp(max=C - 1))
    parent_row = torch.where(
        parent_cand < 0, 0, row_of.gather(1, parent_cand.clamp(min=0))
    )  # -1 where the parent was not picked

    # A picked candidate survives when its parent is the root or a surviving candidate;
    # parents precede children, so one pass in order settles every candidate.
    batch = torch.arange(B, device=device)
    alive = torch.zeros((B, m + 1), dtype=torch.bool, device=device)
    alive[:, 0] = True
    for i in range(m):
        parent = parent_row[:, i]
        alive[:, i + 1] = real[:, i] & (parent >= 0) & alive[batch, parent.clamp(min=0)]
    survivors = alive[:, 1:]
    # Compact the survivors to the front: new row of old row r is 1 + survivors before it.
    new_row = torch.zeros((B, m + 1), dtype=torch.int64, device=device)
    new_row[:, 1:] = survivors.cumsum(dim=1)
    new_parent = new_row.gather(1, parent_row.clamp(min=0))
    # Survivors' ranks among themselves: by their rank among all candidates.
    score_rank = torch.where(survivors, rank_of.gather(1, picked.clamp(max=C - 1)), C)
    own_rank = score_rank.argsort(dim=1, stable=True).argsort(dim=1)

    node_tokens = tokens.gather(1, picked.clamp(max=C - 1))
    # each survivor to its row, the others to a column past the trees' (dropped after)
    column = torch.where(survivors, new_row[:, 1:], width)
    columns = (node_tokens, new_parent, own_rank)
    tokens_out, parents_out, ranks_out = _survivor_rows(root_tokens, column, columns, width)
    return _assemble(tokens_out, parents_out, [], ranks_out)


def _check_candidates(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sizes: list[int],
    checked_values: bool,
) -> None:
    """ValueError unless the tables share one shape [B, C], with B tree sizes >= 1 (and,
    with `checked_values`, each parent -1 or an earlier candidate: a host read)."""
    B, C = scores.shape
    if not sizes or min(sizes) < 1:
        raise ValueError(f"num_draft_tokens must be >= 1 (got {sizes})")
    if tokens.shape != (B, C) or parents.shape != (B, C) or len(sizes) != B:
        raise ValueError(
            f"scores, tokens and parent_candidates must share one shape [B, C], with one tree "
            f"size per request (got {tuple(scores.shape)}, {tuple(tokens.shape)}, "
            f"{tuple(parents.shape)} and {len(sizes)} sizes)"
        )
    own = torch.arange(C, device=parents.device)
    if checked_values and ((parents < -1) | (parents >= own)).any():
        raise ValueError("every parent candidate must be -1 or an index below the candidate's")


def _survivor_rows(
    roots: torch.Tensor, column: torch.Tensor, values: tuple[torch.Tensor, ...], width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens (the roots first), parents and ranks [B, width]: each picked candidate's
    `values` (token, tree parent, rank) placed at its `column` (width: dropped), the rest
    padding (token 0, parent and rank -1)."""
    B = roots.shape[0]
    out = [
        torch.full((B, width + 1), fill, dtype=torch.int64, device=roots.device)
        for fill in (0, -1, -1)
    ]
    out[0][:, 0] = roots
    for dest, value in zip(out, values):
        dest.scatter_(1, column, value)
    return tuple(x[:, :width].contiguous() for x in out)  # type: ignore[return-value]


def tree_positions(trees: DraftTrees, seq_lens: torch.Tensor) -> torch.Tensor:
    """Position of every node [B, n]: the root sits at seq_lens[b], a node at depth d below it
    at seq_lens[b] + d (padding at seq_lens[b])."""
    return seq_lens.cpu().to(torch.int64)[:, None] + trees.depths


def tree_mask_places(sizes: list[int], n: int) -> np.ndarray:
    """Where each request's flattened [s, s] tree mask goes among [B, n, n] masks (trees of
    `sizes` nodes padded to n)."""
    parts = [
        b * n * n + (np.arange(s)[:, None] * n + np.arange(s)[None, :]).ravel()
        for b, s in enumerate(sizes)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
