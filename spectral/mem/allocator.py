"""Free-list allocator over token-granular KV slots, lowest free slots first.

Slot 0 is a dummy that padding points to; it is never handed out. Slots are plain ints on the
CPU: the scheduler owns them and the worker only sees them as index tensors.

The free slots are a heap: an allocation takes the lowest-numbered ones, in order. A pool kept
at its low end stays dense where the scheduler frees slots in any order (a tree's rejected
nodes, finished requests, a flushed cache), and attention reads a request's keys from nearby
rows: a stack of freed slots scattered them over the pool, and at batch 16 a decode step read
its KV 3-5% slower after a few hundred requests (docs/benchmarks.md, "KV slots lowest first").
"""

from __future__ import annotations

import heapq

# A free of at least this many slots (a flushed cache, a long request) rebuilds the heap
# whole rather than pushing slot by slot.
HEAPIFY_AT = 256


class OutOfSlotsError(RuntimeError):
    """Raised when an allocation asks for more slots than are free."""


class TokenSlotAllocator:
    def __init__(self, num_slots: int) -> None:
        """`num_slots` usable slots, numbered 1..num_slots (slot 0 is the dummy)."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1 (got {num_slots})")
        self.num_slots = num_slots
        self._free: list[int] = list(range(1, num_slots + 1))  # a heap (sorted is one)
        self._is_free = bytearray(b"\x01" * (num_slots + 1))
        self._is_free[0] = 0

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Hand out the `n` lowest free slots, ascending; the caller owns them until it
        passes them to `free`."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > len(self._free):
            raise OutOfSlotsError(f"asked for {n} KV slots, {len(self._free)} free")
        free, pop = self._free, heapq.heappop
        taken = [pop(free) for _ in range(n)]
        for s in taken:
            self._is_free[s] = 0
        return taken

    def free(self, slots: list[int]) -> None:
        """Take back slots the caller owned. Freeing a free or unknown slot is an error."""
        for s in slots:
            if s < 1 or s > self.num_slots:
                raise ValueError(f"slot {s} is outside 1..{self.num_slots}")
            if self._is_free[s]:
                raise ValueError(f"slot {s} freed twice")
            self._is_free[s] = 1
        if len(slots) >= HEAPIFY_AT:
            self._free.extend(slots)
            heapq.heapify(self._free)
        else:
            free, push = self._free, heapq.heappush
            for s in slots:
                push(free, s)

    def snapshot(self) -> tuple[list[int], bytes]:
        """Remember the free list, for scratch allocations undone by `restore`."""
        return list(self._free), bytes(self._is_free)

    def restore(self, state: tuple[list[int], bytes]) -> None:
        """Return to a `snapshot`: every slot allocated since then is free again."""
        free, is_free = state
        self._free = list(free)
        self._is_free = bytearray(is_free)
