"""The request-to-token table: one row per running request, the KV slot of each position.

The scheduler decides which row a request gets; this table only records slots. One row more
than `max_requests` is kept, `dummy_row`, all slot 0 (the dummy KV slot): padded requests of a
batch in static buffers (a CUDA graph's) read it.
"""

from __future__ import annotations

import numpy as np
import torch


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context_len: int, device: str = "cpu") -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.dummy_row = max_requests
        self.table = torch.zeros(
            (max_requests + 1, max_context_len), dtype=torch.int64, device=device
        )
        # The table's memory as a flat NumPy array where it is on the CPU (else None), for the
        # few slots a step writes: torch's per-operation cost is most of a tiny write on a
        # CPU (a decode step's slot by `index_copy_` ~24 us after a forward; bench/step_parts.py).
        on_cpu = self.table.device.type == "cpu"
        self.host: np.ndarray | None = self.table.view(-1).numpy() if on_cpu else None

    def write(self, row: int, start: int, slots: list[int] | torch.Tensor) -> None:
        """Record the slots of positions start, start+1, ... of request `row`."""
        values = torch.as_tensor(slots, dtype=torch.int64)
        end = start + values.numel()
        self.check_fits(end)
        self.table[row, start:end] = values.to(self.table.device)

    def check_fits(self, end: int) -> None:
        """ValueError where positions up to `end` (exclusive) do not fit a row."""
        if end > self.max_context_len:
            raise ValueError(
                f"position {end - 1} exceeds the context length {self.max_context_len}"
            )

    def read(self, row: int, length: int) -> list[int]:
        """The slots of the first `length` positions of request `row`."""
        return self.table[row, :length].tolist()
