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
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

Candidates = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Expand = Callable[[torch.Tensor, torch.Tensor, int], Candidates]


class DraftGraphs:
    def __init__(
        self,
        expand: Expand,
        dummy_row: int,
        batch_sizes: list[int],
        max_steps: int,
        device: str | torch.device,
    ) -> None:
        self.expand = expand
        self.dummy_row = dummy_row
        self.batch_sizes = sorted(batch_sizes)
        # depth 1 is the first level alone (no forward): nothing to capture
        self.depths = list(range(2, max_steps + 1))
        self.device = torch.device(device)
        largest = self.batch_sizes[-1]
        self.rows = torch.full((largest,), dummy_row, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.ones(largest, dtype=torch.int64, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Candidates]] = {}
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
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

    def batch_size_for(self, batch_size: int) -> int | None:
        """The smallest batch size of the static path that holds `batch_size` requests."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    @torch.inference_mode()
    def run(self, rows: torch.Tensor, seq_lens: torch.Tensor, steps: int) -> Candidates | None:
        """The candidates of `rows` (table rows) at verified lengths `seq_lens`, `steps`
        levels deep; None where no static batch size holds them (the caller expands eagerly)."""
        real = rows.shape[0]
        size = self.batch_size_for(real)
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
        """Capture every (batch size, depth), largest first, in one memory pool (CUDA only);
        each runs twice eagerly first (kernel builds, autotuning)."""
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info()
        stream = torch.cuda.Stream()
        pool = None
        self.rows.fill_(self.dummy_row)
        self.seq_lens.fill_(1)
        for size in reversed(self.batch_sizes):
            for steps in reversed(self.depths):
                rows, seq_lens = self.rows[:size], self.seq_lens[:size]
                for _ in range(2):
                    self.expand(rows, seq_lens, steps)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.expand(rows, seq_lens, steps)
                pool = graph.pool()
                self.graphs[(size, steps)] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info(
            "CUDA graphs: %d draft expansions captured in %.1f s, %.0f MiB",
            len(self.graphs),
            self.capture_seconds,
            self.graph_memory_bytes / 2**20,
        )

    def summary(self) -> dict:
        """What /get_server_info reports under cuda_graph's `draft`."""
        return {
            "captured": bool(self.graphs),
            "batch_sizes": self.batch_sizes,
            "depths": self.depths,
            "capture_s": round(self.capture_seconds, 2),
            "memory_mib": round(self.graph_memory_bytes / 2**20, 1),
        }


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
