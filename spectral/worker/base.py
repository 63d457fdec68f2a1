"""Worker: what the scheduler drives, in-process or in a worker process. One forward per step;
the optional parts are None where a worker has none."""

from __future__ import annotations

from typing import Protocol

from spectral.core.worker_io import WorkerBatch, WorkerResult
from spectral.speculative.cost_model import CostModel
from spectral.worker.grammar_follower import GrammarFollower


class Worker(Protocol):
    num_kv_slots: int
    # What speculative rounds cost here: the scheduler's planner sizes trees by it (None: no
    # speculation, or trees of fixed size).
    cost_model: CostModel | None
    # Speculation only: the worker's own matchers, to mask draft trees node by node.
    grammars: GrammarFollower | None

    def forward(self, batch: WorkerBatch) -> WorkerResult: ...

    def kv_pool_info(self) -> dict:
        """The KV pool's bytes and whether they were committed at start (`draft_bytes`: a
        drafter's own pool), for /get_server_info."""

    def grammar_ready(self, kind: str, text: str) -> bool:
        """Whether the worker can mask draft trees under this grammar now (always, where it
        follows none); starts its compile where it has not, without waiting for it."""

    def graph_info(self) -> dict | None:
        """The graph runner's buckets, capture time and memory (None: no runner)."""
