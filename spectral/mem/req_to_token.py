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
        # The table's memory as a flat NumPy array where it is on the CPU (else None): see
        # `write_places`.
        self.on_cpu = self.table.device.type == "cpu"
        self._host: np.ndarray | None = self.table.view(-1).numpy() if self.on_cpu else None

    def write_places(
        self, places: torch.Tensor | list[int], slots: torch.Tensor | list[int]
    ) -> None:
        """Record `slots` at `places` of the flattened table: int64 tensors where the table
        is, or on a CPU host lists too. On a CPU through NumPy: torch's per-operation cost is
        most of the few slots a step writes (a decode step's one by `index_copy_` ~24 us after
        a forward; bench/step_parts.py)."""
        if self._host is not None:
            self._host[np.asarray(places, dtype=np.int64)] = np.asarray(slots)
        else:
            self.table.view(-1).index_copy_(0, places, slots)

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
