"""A model's weights moved into a few large allocations (slabs), on transparent huge pages.

A decode step at a small batch streams every weight. PyTorch's CPU allocator puts only blocks of
2 MiB and more on huge pages (THP_MEM_ALLOC_ENABLE, spectral/__init__.py): a small model's
weights, each a fraction of a MiB, sit on 4 KiB pages scattered through the heap, and weights
served straight from a GGUF file's mapping on the page cache's pages. `gather` copies each
storage into a slab and rebinds every tensor that views it in place (`Tensor.set_`), so that
whatever holds the tensor (a module, a packed weight) reads the slab from then on.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

SLAB_BYTES = 64 << 20  # a slab's size where storages are smaller (one larger gets its own)
ALIGN = 64  # each storage's start in a slab: a cache line (and any dtype's alignment)

# the slabs alive, as (start, end) addresses: a storage in one is not moved again (a head's
# tensors shared with its target's)
_slabs: list[tuple[int, int, StorageWeakRef]] = []


def gather(tensors: Iterable[torch.Tensor]) -> int:
    """Move the CPU storages of `tensors` into slabs, in the order given (a model's layers', as
    a forward reads them); every tensor among `tensors` that views a moved storage views the
    slab after, with its values, shape and strides. Tensors not given that view a moved storage
    keep the old one (still valid, its memory kept). Returns the bytes moved."""
    _slabs[:] = [slab for slab in _slabs if not slab[2].expired()]  # a freed model's go
    groups: dict[int, list[torch.Tensor]] = {}  # each storage's holders, by its address
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.layout is not torch.strided:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or _in_slab(storage.data_ptr()):
            continue
        holders = groups.setdefault(storage.data_ptr(), [])
        if all(held is not tensor for held in holders):  # a tied weight comes twice
            holders.append(tensor)
    # storages are reached only through their holders: each is freed as soon as they are
    # rebound, so a load's peak is the weights and one slab
    moved, batch, size = 0, [], 0
    for holders in groups.values():
        nbytes = holders[0].untyped_storage().nbytes()
        if batch and size + nbytes > SLAB_BYTES:
            _fill(batch, size)
            batch, size = [], 0
        batch.append((size, holders))
        size += -(-nbytes // ALIGN) * ALIGN
        moved += nbytes
    if batch:
        _fill(batch, size)
    return moved


def _fill(batch: list[tuple[int, list[torch.Tensor]]], size: int) -> None:
    """One slab of `size` bytes holding, at each (offset, holders) of `batch`, the storage the
    holders view, each of them rebound to it."""
    slab = torch.empty(size, dtype=torch.uint8)
    storage = slab.untyped_storage()
    start = storage.data_ptr()
    _slabs.append((start, start + size, StorageWeakRef(storage)))
    with torch.no_grad():
        for offset, holders in batch:
            old = torch.empty(0, dtype=torch.uint8).set_(holders[0].untyped_storage())
            slab[offset : offset + old.numel()].copy_(old)
            del old
            for tensor in holders:
                width = tensor.element_size()
                at = offset // width + tensor.storage_offset()
                tensor.set_(storage, at, tensor.size(), tensor.stride())


def _in_slab(address: int) -> bool:
    return any(start <= address < end and not ref.expired() for start, end, ref in _slabs)
