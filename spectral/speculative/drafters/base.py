"""The interface of a drafter that runs in the model worker, and what it is built from.

A drafter follows the target: every prefill or plain decode step (`observe_step`) and every
verified round (`observe_round`) tell it what the target computed and kept, and `draft`
proposes each request's candidates for the next round, which the worker turns into trees and
verifies in one target forward. Its KV (where it keeps any) lives in slots the scheduler owns:
the target's slot of a position also indexes the drafter's KV there, so freeing the target's
slots frees the drafter's; scratch for tree levels is its own and released within `draft`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from spectral.core.forward import ForwardBatch
from spectral.core.model import ResolvedModel


@dataclass
class DrafterContext:
    """What a drafter is built from: the run's speculative settings (`spec`: SpecSettings)
    and server arguments (`args`: ServerArgs), the resolved target model, the target's worker
    (`target`: ModelWorker: its config, model, req-to-token table, KV slots, dtype and
    device), and `load_lm`, for a drafter that runs an LM of its own:
    `load_lm(path, num_kv_slots, max_requests, max_context_len, quantize)` gives that LM's
    worker, loaded as the target is (dtype, device, --quantization, attention backend), and
    its tokenizer's vocabulary; `target_vocab()` the target tokenizer's."""

    spec: Any
    args: Any
    model: ResolvedModel
    target: Any
    load_lm: Callable[[str, int, int, int, str | None], tuple[Any, dict[str, int]]]
    target_vocab: Callable[[], dict[str, int]]


class Drafter(Protocol):
    # Target layers whose input hidden states the drafter reads (EAGLE-3's three), and
    # whether it reads features at all (the target's hidden states at the observed tokens).
    capture_layers: tuple[int, ...]
    needs_features: bool
    # What identifies the drafter for the cost model's cache (its files' stamps, its shape).
    cost_key: Any

    def observe_step(
        self,
        batch: ForwardBatch,
        next_ids: list[int],
        features: torch.Tensor | list[torch.Tensor] | None,
    ) -> None:
        """A prefill or plain decode step of the target: `next_ids` the token after each
        request's last position; `features` its hidden states (where `needs_features`), as the
        states of `capture_layers` (a list, to join along the last dimension) where it has
        any."""

    def observe_round(
        self,
        batch: ForwardBatch,
        prefix_lens: list[int],
        accepted_tokens: list[list[int]],
        emitted: list[list[int]],
        kept_slots: torch.Tensor,
        features: torch.Tensor | None,
        drafted: bool = True,
    ) -> None:
        """A verified round: per request its accepted nodes' tokens (root first) and the
        tokens emitted after them, the slots they keep (request after request) and the
        target's features there; `drafted` whether this drafter drafted the round's trees."""

    def flush(self) -> None:
        """Run now whatever recording steps deferred (a head's queued KV); nothing where the
        drafter defers nothing."""

    def top1(self, rows: list[int]) -> list[float | None]:
        """Per request row, the drafter's top-1 probability after its last verified token
        (None where not known): the confidence the planner sizes its next tree by."""
        ...

    def use_graphs(self, batch_sizes: list[int]) -> dict | None:
        """Draft batches of up to max(batch_sizes) requests through static buffers (CUDA
        graphs where the drafter runs on a GPU); returns their summary for /get_server_info,
        or None where this drafter has no static path (it drafts eagerly)."""
        ...

    def draft(
        self,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_steps: int | None = None,
        roots: torch.Tensor | None = None,
        root_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidates below each request's root (rows: table rows; seq_lens: verified
        lengths, the root included; roots and their slots), at most `num_steps` levels deep:
        (cumulative log-prob, target token id, parent candidate or -1 under the root), each
        [B, C], level by level, parents before children (drafters.expansion's layout)."""
        ...


def file_stamp(path: str | Path | None) -> list | None:
    """A file's (or a directory's files') path, size and modification time: a cost key part
    that changes when the files do."""
    if path is None:
        return None
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
