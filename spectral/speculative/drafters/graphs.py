"""A drafter's tree expansion through static buffers, one CUDA graph per batch size and depth.

The expansion (`expand(rows, seq_lens, steps)`: the candidates of `steps` levels below each
request's root, in TreeExpansion's layout) must read nothing on the host. A batch runs in the
smallest captured batch size that holds it: its rows first, then padded rows (the
req-to-token table's dummy row, one key), and the real rows' candidates are sliced back. On a
GPU each (batch size, depth) is captured once at start, largest first, into one memory pool;
elsewhere the same static path runs eagerly, which is how it is tested on a CPU.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

import torch

from spectral.core.cuda_graphs import StaticGraphs

Candidates = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Expand = Callable[[torch.Tensor, torch.Tensor, int], Candidates]


class DraftGraphs(StaticGraphs):
    def __init__(
        self,
        expand: Expand,
        dummy_row: int,
        batch_sizes: list[int],
        max_steps: int,
        device: str | torch.device,
    ) -> None:
        super().__init__()
        self.expand = expand
        self.dummy_row = dummy_row
        self.batch_sizes = sorted(batch_sizes)
        # depth 1 is the first level alone (no forward): nothing to capture
        self.depths = list(range(2, max_steps + 1))
        self.device = torch.device(device)
        largest = self.batch_sizes[-1]
        self.rows = torch.full((largest,), dummy_row, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.ones(largest, dtype=torch.int64, device=self.device)
        self.static_runs = 0  # drafts that took the static path (replayed or eager)

    @classmethod
    def start(
        cls,
        expand: Expand,
        dummy_row: int,
        batch_sizes: list[int],
        max_steps: int,
        device: str | torch.device,
    ) -> DraftGraphs:
        """The static path for `expand`, captured where `device` is a GPU."""
        graphs = cls(expand, dummy_row, sorted(set(batch_sizes)), max_steps, device)
        if graphs.device.type == "cuda":
            graphs.capture()
        return graphs

    @torch.inference_mode()
    def run(self, rows: torch.Tensor, seq_lens: torch.Tensor, steps: int) -> Candidates | None:
        """The candidates of `rows` (table rows) at verified lengths `seq_lens`, `steps`
        levels deep; None where no static batch size holds them (the caller expands eagerly)."""
        real = rows.shape[0]
        size = smallest_holding(self.batch_sizes, real)
        if size is None or steps < 2:
            return None
        self.rows[:real].copy_(rows)
        self.rows[real:size].fill_(self.dummy_row)
        self.seq_lens[:real].copy_(seq_lens)
        self.seq_lens[real:size].fill_(1)
        self.static_runs += 1
        captured = self.graphs.get((size, steps))
        if captured is None:
            out = self.expand(self.rows[:size], self.seq_lens[:size], steps)
        else:
            graph, out = captured
            graph.replay()
        return tuple(x[:real].clone() for x in out)  # type: ignore[return-value]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, depth), largest first, in one memory pool (CUDA only)."""
        self.rows.fill_(self.dummy_row)
        self.seq_lens.fill_(1)
        runs = {
            (size, steps): functools.partial(
                self.expand, self.rows[:size], self.seq_lens[:size], steps
            )
            for size in reversed(self.batch_sizes)
            for steps in reversed(self.depths)
        }
        self.capture_runs(runs, "draft expansions")

    def summary(self) -> dict:
        """What /get_server_info reports under cuda_graph's `draft`."""
        return self.summary_with(batch_sizes=self.batch_sizes, depths=self.depths)


def smallest_holding(sizes: list[int], count: int) -> int | None:
    """The smallest of the sorted `sizes` that is at least `count`, None if none is."""
    i = bisect.bisect_left(sizes, count)
    return sizes[i] if i < len(sizes) else None


def expand_through(
    graphs: DraftGraphs | None,
    expand: Expand,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    steps: int,
) -> Candidates:
    """`expand(rows, seq_lens, steps)` through `graphs` where it holds the batch, else eagerly."""
    if graphs is not None:
        drafted = graphs.run(rows, seq_lens, steps)
        if drafted is not None:
            return drafted
    return expand(rows, seq_lens, steps)
