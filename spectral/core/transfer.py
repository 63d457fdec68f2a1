"""Host values to the device without making the host wait for it."""

from __future__ import annotations

import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, queued behind the work
    already there instead of waiting for it (a plain copy from pageable memory synchronises)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return pinned(host, device).to(device, non_blocking=True)


def pinned(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` in pinned memory where it is bound for a GPU (a copy from it need not wait)."""
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def on_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` as a tensor of `dtype` on `device` (`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def stage(parts: dict[str, list[int]], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Named lists of ints as int64 tensors on `device`, in one copy (`to_device`): views of
    one staged tensor, by name."""
    flat = [v for values in parts.values() for v in values]
    if torch.device(device).type == "cpu":  # views of a NumPy array: torch's slices cost more
        array = np.array(flat, dtype=np.int64)

        def view(start: int, end: int) -> torch.Tensor:
            return torch.from_numpy(array[start:end])
    else:
        staged = to_device(torch.tensor(flat, dtype=torch.int64), device)

        def view(start: int, end: int) -> torch.Tensor:
            return staged[start:end]

    out, start = {}, 0
    for name, values in parts.items():
        out[name] = view(start, start + len(values))
        start += len(values)
    return out
