"""KV memory: the request-to-token table, the KV pool and its slot allocator."""

from spectral.mem.allocator import OutOfSlotsError, TokenSlotAllocator
from spectral.mem.kv_pool import KVPool
from spectral.mem.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "OutOfSlotsError", "ReqToTokenPool", "TokenSlotAllocator"]
