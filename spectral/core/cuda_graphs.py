"""CUDA graph capture shared by the target's graph runner and the drafters' static paths."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

Key = TypeVar("Key", bound=Hashable)


_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The current GPU's one stream for captures, for the process's life: every engine's
    graphs are captured on it, so no per-stream state outlives a stream whose address a later
    one takes."""
    device = torch.cuda.current_device()
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device)
    return _capture_streams[device]


def capture_graphs(
    runs: dict[Key, Callable[[], Any]],
    prepare: Callable[[Key], None] | None = None,
    pool: Any = None,
) -> tuple[dict[Key, tuple[torch.cuda.CUDAGraph, Any]], float, int]:
    """Each run captured as a CUDA graph, in `runs`' order (largest first), into one memory
    pool (`pool`, an earlier graph's, or a new one), after two eager runs (kernel builds,
    autotuning); `prepare(key)`, where given, runs
    on the host before each run and before the capture, outside the graph (an attention
    plan into the captured buffers). Returns the graphs with their outputs by key, the seconds
    taken and the device memory taken."""
    start = time.perf_counter()
    free_before, _ = torch.cuda.mem_get_info()
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = {}
    # The warm-up runs on the capture stream too: what a library sets up per stream (cuBLAS's
    # workspace) is then made outside the capture, not inside a graph's pool.
    with torch.cuda.stream(stream):
        for key, run in runs.items():
            for _ in range(2):
                if prepare is not None:
                    prepare(key)
                run()
                torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            if prepare is not None:
                prepare(key)
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = run()
            pool = graph.pool()
            graphs[key] = (graph, out)
    torch.cuda.synchronize()
    used = max(0, free_before - torch.cuda.mem_get_info()[0])
    return graphs, time.perf_counter() - start, used


class StaticGraphs:
    """What a static path captured (CUDA graphs by key, none on a CPU) and what capturing them
    took; the base of the target's graph runner and the drafters' static paths."""

    def __init__(self) -> None:
        self.graphs: dict = {}
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    def capture_runs(
        self,
        runs: dict[Key, Callable[[], Any]],
        what: str,
        prepare: Callable[[Key], None] | None = None,
    ) -> None:
        """`capture_graphs(runs, prepare)` into `graphs`, logged as `what` was captured."""
        self.graphs, self.capture_seconds, self.graph_memory_bytes = capture_graphs(runs, prepare)
        logger.info(
            "CUDA graphs: %d %s captured in %.1f s, %.0f MiB",
            len(self.graphs),
            what,
            self.capture_seconds,
            self.graph_memory_bytes / 2**20,
        )

    def summary_with(self, **fields: Any) -> dict:
        """What /get_server_info reports: whether captured, `fields`, the capture's time and
        graph memory."""
        return {
            "captured": bool(self.graphs),
            **fields,
            "capture_s": round(self.capture_seconds, 2),
            "memory_mib": round(self.graph_memory_bytes / 2**20, 1),
        }
