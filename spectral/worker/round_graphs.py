"""A greedy round's own device work through static buffers, as CUDA graphs: the EAGLE-2
selection of the trees from the drafter's candidates (before the target's verify graph) and
the greedy walk over the verified nodes (after it).

Eagerly, these are some 270 small operations a round (the selection's passes over the nodes,
the tree's mask and links, the walk), each a kernel launch the host pays for between the
drafter's graph and the target's. Here each (batch size, tree size, candidates) shape is
captured the first time a round of that shape runs, into one memory pool, and replayed after:
the real requests' rows first, then padding rows that select nothing. On a CPU the same
static buffers run eagerly, which is how the path is tested there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spectral.core.cuda_graphs import StaticGraphs, capture_graphs
from spectral.speculative.drafters.graphs import smallest_holding
from spectral.speculative.tree import DraftTrees, candidates_kept, select_trees_static
from spectral.speculative.verify import packed_round

Key = tuple[int, int, int]  # (batch size, tree size, candidates a request)


class _Shape:
    """One shape's static inputs, its selected trees and its walk's packed result."""

    def __init__(self, bs: int, n: int, candidates: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.roots = zeros(bs)
        self.scores = zeros(bs, candidates, dtype=torch.float32)
        self.tokens = zeros(bs, candidates)
        self.parents = torch.full((bs, candidates), -1, dtype=torch.int64, device=device)
        self.wanted = zeros(bs)  # padding rows want none
        self.choices = torch.full((bs, n), -1, dtype=torch.int64, device=device)
        self.m = min(n - 1, candidates)
        self.n = n
        self.trees: DraftTrees | None = None  # the selection's outputs (static on a GPU)

    def select(self) -> DraftTrees:
        wanted = self.wanted.clamp(max=self.scores.shape[1])
        args = (self.roots, self.scores, self.tokens, self.parents, wanted, self.m, self.n)
        return select_trees_static(*args)

    def accept(self) -> torch.Tensor:
        assert self.trees is not None
        return packed_round(self.trees, self.choices, self.scores)


class RoundGraphs(StaticGraphs):
    """The selection and the walk of greedy rounds of up to max(batch_sizes) requests."""

    def __init__(self, batch_sizes: list[int], device: str | torch.device) -> None:
        super().__init__()
        self.batch_sizes = sorted(batch_sizes)
        self.device = torch.device(device)
        self.shapes: dict[Key, _Shape] = {}
        self.pool = None
        self.static_runs = 0  # rounds that took the static path (replayed or eager)
        self._last: tuple[_Shape, int] | None = None  # the round selected last, its real rows

    @torch.inference_mode()
    def select(
        self,
        roots: torch.Tensor,
        scores: torch.Tensor,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        wanted: torch.Tensor,
        sizes: list[int],
    ) -> DraftTrees | None:
        """`select_eagle_trees(roots, scores, tokens, parents, sizes, on_device=True)` for the
        real requests (`wanted`: sizes[b] - 1 each, on the device), or None where no batch
        size holds them (the caller selects eagerly)."""
        real, candidates = scores.shape
        bs = smallest_holding(self.batch_sizes, real)
        self._last = None
        if bs is None:
            return None
        shape = self._shape((bs, max(sizes), candidates))
        for buffer, values in (
            (shape.roots, roots),
            (shape.scores, scores),
            (shape.tokens, tokens),
            (shape.parents, parents),
            (shape.wanted, wanted),
        ):
            buffer[:real].copy_(values)
        shape.wanted[real:].zero_()
        shape.trees = self._run(("select", shape), shape.select)
        self._last = (shape, real)
        self.static_runs += 1
        trees = shape.trees
        return DraftTrees(
            *(x[:real] for x in (trees.tokens, trees.parents, trees.depths, trees.mask)),
            next_token=trees.next_token[:real],
            next_sibling=trees.next_sibling[:real],
            num_nodes=[1 + kept for kept in candidates_kept(sizes, candidates)],
            ranks=trees.ranks[:real],
        )

    @torch.inference_mode()
    def accept(self, choices: torch.Tensor) -> list[list[float]] | None:
        """The greedy walk over the trees `select` gave last, the target's choice at each node
        `choices` [real, n] (-1 at padding nodes): per request its packed verdict, node ranks
        and candidates' scores, read in one copy; None where `select` did not hold the round."""
        if self._last is None:
            return None
        shape, real = self._last
        shape.choices[:real].copy_(choices)
        shape.choices[real:].fill_(-1)
        packed = self._run(("accept", shape), shape.accept)
        return packed[:real].tolist()

    def _shape(self, key: Key) -> _Shape:
        if key not in self.shapes:
            self.shapes[key] = _Shape(*key, self.device)
        return self.shapes[key]

    def _run(self, key: tuple[str, _Shape], run: Callable[[], object]):
        """`run()` over its shape's buffers: replayed from its graph on a GPU (captured the
        first time), eagerly elsewhere."""
        if self.device.type != "cuda":
            return run()
        if key not in self.graphs:
            captured, seconds, used = capture_graphs({key: run}, pool=self.pool)
            self.graphs |= captured
            self.pool = captured[key][0].pool()
            self.capture_seconds += seconds
            self.graph_memory_bytes += used
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def summary(self) -> dict:
        """What /get_server_info reports under cuda_graph's `draft` `round`."""
        keys = sorted((k[1].roots.shape[0], k[1].n) for k in self.graphs if k[0] == "select")
        return self.summary_with(batch_sizes=self.batch_sizes, shapes=keys)
