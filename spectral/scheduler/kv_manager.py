"""KVManager: the scheduler's bookkeeping of KV slots, request rows and the radix tree.

It owns the allocator and the tree. Every slot is at any time in exactly one place: free in
the allocator, in the tree (evictable or protected), or owned by one request
(`req.kv_slots[req.protected_len:]`, or held for its next tokens in `req.kv_spare`).
"""

from __future__ import annotations

from spectral.core.req import Req
from spectral.mem.allocator import OutOfSlotsError, TokenSlotAllocator
from spectral.mem.radix_cache import RadixCache, TreeNode

# While the pool is roomy a request takes slots SPARE_RUN ahead of its tokens (`take`), so
# that a request's KV lies in runs of its own rather than one slot in B of a decode step's
# batch: a step at batch 16 reads its keys ~10% faster from runs of 16 than from slots
# interleaved with the other requests' (docs/benchmarks.md, "KV slots lowest first").
SPARE_RUN = 16


class KVManager:
    def __init__(
        self,
        num_kv_slots: int,
        max_running_requests: int,
        disable_radix_cache: bool,
        draft_kv_shift: bool = False,
    ) -> None:
        """With `draft_kv_shift` (an EAGLE head shares the slots), the last position of a
        matched prefix is never reused: the head's KV there paired it with a next token that
        the new request may not share."""
        self.draft_kv_shift = draft_kv_shift
        self.allocator = TokenSlotAllocator(num_kv_slots)
        self.tree = RadixCache(self.allocator, disable=disable_radix_cache)
        self.max_rows = max_running_requests
        self.free_rows: list[int] = list(range(max_running_requests - 1, -1, -1))

    @property
    def available(self) -> int:
        """Slots a new allocation can get: free ones plus what eviction can reclaim."""
        return self.allocator.free_count + self.tree.evictable_size

    def alloc_slots(self, n: int) -> list[int]:
        """`n` slots for the caller, evicting from the tree first if needed."""
        short = n - self.allocator.free_count
        if short > 0:
            self.tree.evict(short)
        if n > self.allocator.free_count:
            raise OutOfSlotsError(
                f"asked for {n} KV slots; {self.allocator.free_count} free after eviction"
            )
        return self.allocator.alloc(n)

    def _roomy(self, n: int) -> bool:
        """Whether `n` more slots leave every request room for a spare run."""
        return self.allocator.free_count >= n + SPARE_RUN * (self.max_rows + 1)

    def take(self, req: Req, n: int) -> list[int]:
        """`n` slots for `req`'s next tokens: its spare ones first (lowest first), then new
        ones, SPARE_RUN more than it needs while the pool is roomy."""
        spare = req.kv_spare
        if len(spare) < n:
            want = n - len(spare)
            spare.extend(self.alloc_slots(want + SPARE_RUN if self._roomy(want) else want))
        taken = spare[:n]
        del spare[:n]
        return taken

    def give_back(self, req: Req, slots: list[int]) -> None:
        """Slots `req` took and left unused (a tree's rejected nodes): its next tokens take
        them first, as many as it took this time or SPARE_RUN while the pool is roomy, the
        rest freed."""
        spare = sorted(req.kv_spare + slots)
        keep = max(len(slots), SPARE_RUN) if self._roomy(0) else 0
        req.kv_spare = spare[:keep]
        self.allocator.free(spare[keep:])

    def match(self, req: Req, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """The cached prefix of `tokens` that `req` may reuse (slots and tree node); locks
        nothing."""
        prefix = req.cacheable_prefix(tokens)
        slots, node = self.tree.match_prefix(prefix)
        if self.draft_kv_shift and slots:
            slots, node = self.tree.match_prefix(prefix[: len(slots) - 1])
        return slots, node

    def admit(self, req: Req, tokens: list[int]) -> int:
        """Give `req` a row and the cached prefix of `tokens` (see `Req.cacheable_prefix`);
        lock that prefix. Returns the prefix length."""
        slots, node = self.match(req, tokens)
        self.tree.lock(node)
        req.req_pool_idx = self.free_rows.pop()
        req.kv_slots = list(slots)
        req.protected_len = len(slots)
        req.last_node = node
        req.table_stale_from = 0
        return len(slots)

    def cache_unfinished(self, req: Req) -> None:
        """Put the request's computed tokens in the tree (so others can share them) and swap its
        slots for the tree's where the tree already had them; the request keeps a lock."""
        if self.tree.disable:
            return
        tokens = req.all_ids[: req.seq_len]
        freed_duplicates = self._insert(req, tokens)
        slots, node = self.tree.match_prefix(tokens)
        self.tree.lock(node)
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        if freed_duplicates:
            stale = req.protected_len
            req.table_stale_from = (
                stale if req.table_stale_from is None else min(req.table_stale_from, stale)
            )
        req.kv_slots = slots
        req.protected_len = len(slots)
        req.last_node = node

    def _insert(self, req: Req, tokens: list[int]) -> bool:
        """Hand the request's computed tokens to the tree and free its own slots for tokens the
        tree already held (all of them without a tree). Returns whether any were freed."""
        cached = self.tree.insert(tokens, req.kv_slots)
        duplicates = req.kv_slots[req.protected_len : cached]
        if duplicates:
            self.allocator.free(duplicates)
        return bool(duplicates)

    def forget_after(self, req: Req, computed: int) -> None:
        """Free the request's slots from position `computed` on (their KV was never computed,
        so the radix cache must not get them)."""
        if computed < req.seq_len:
            self.allocator.free(req.kv_slots[computed:])
            del req.kv_slots[computed:]

    def release(self, req: Req) -> None:
        """The request gives up its KV: computed tokens go to the tree (or back to the
        allocator without a tree), the lock and the row are released, its spare slots freed."""
        self.allocator.free(req.kv_spare)
        req.kv_spare = []
        if req.req_pool_idx is None:
            return
        self._insert(req, req.all_ids[: req.seq_len])
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
        self.free_rows.append(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_slots = []
        req.protected_len = 0
        req.last_node = None
        req.table_stale_from = None

    def memory(self) -> dict[str, int]:
        return {
            "total_tokens": self.allocator.num_slots,
            "free_tokens": self.allocator.free_count,
            "evictable_tokens": self.tree.evictable_size,
            "protected_tokens": self.tree.protected_size,
        }
