"""RadixCache: unit behaviour and a property test against a naive reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.mem.allocator import TokenSlotAllocator
from spectral.mem.radix_cache import RadixCache


def cache_with(*seqs: list[int], pool: int = 1000) -> tuple[RadixCache, TokenSlotAllocator]:
    alloc = TokenSlotAllocator(pool)
    cache = RadixCache(alloc)
    for seq in seqs:
        slots = alloc.alloc(len(seq))
        dup = cache.insert(seq, slots)
        alloc.free(slots[:dup])
    return cache, alloc


def test_insert_then_match_returns_the_inserted_slots():
    alloc = TokenSlotAllocator(100)
    cache = RadixCache(alloc)
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    got, _ = cache.match_prefix([1, 2, 3, 9])
    assert got == slots[:3]
    assert cache.evictable_size == 5 and cache.protected_size == 0


def test_insert_reports_the_already_cached_length():
    alloc = TokenSlotAllocator(100)
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3], alloc.alloc(3))
    assert cache.insert([1, 2, 3, 4], alloc.alloc(4)) == 3
    assert cache.insert([1, 2], alloc.alloc(2)) == 2
    assert cache.insert([7], alloc.alloc(1)) == 0


def test_a_match_inside_a_node_splits_it():
    cache, _ = cache_with([1, 2, 3, 4, 5, 6])
    _, node = cache.match_prefix([1, 2, 3, 0])
    assert node.key.tolist() == [1, 2, 3]
    assert [c.key.tolist() for c in node.children.values()] == [[4, 5, 6]]
    assert sorted(cache.cached_sequences()) == [[1, 2, 3, 4, 5, 6]]
    assert cache.total_size == 6


def test_branches_share_their_common_prefix():
    cache, alloc = cache_with([1, 2, 3, 4], [1, 2, 7, 8], [1, 9])
    assert sorted(cache.cached_sequences()) == [[1, 2, 3, 4], [1, 2, 7, 8], [1, 9]]
    assert cache.total_size == 7  # 1,2 shared + 3,4 + 7,8 + 9
    assert alloc.free_count == 1000 - 7


def test_lock_moves_tokens_from_evictable_to_protected_and_back():
    cache, _ = cache_with([1, 2, 3, 4], [1, 2, 5])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.lock(node)
    assert cache.protected_size == 4 and cache.evictable_size == 1
    cache.lock(node)
    cache.unlock(node)
    assert cache.protected_size == 4
    cache.unlock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 5


def test_eviction_takes_least_recently_used_leaves_and_spares_locked_ones():
    cache, alloc = cache_with([1, 2, 3], [4, 5, 6], [7, 8, 9])
    cache.match_prefix([4, 5, 6])  # touch: [1,2,3] is now the oldest
    _, locked = cache.match_prefix([7, 8, 9])
    cache.lock(locked)
    assert cache.evict(1) == 3
    assert sorted(cache.cached_sequences()) == [[4, 5, 6], [7, 8, 9]]
    assert cache.evict(100) == 3
    assert cache.cached_sequences() == [[7, 8, 9]]
    assert alloc.free_count == 1000 - 3
    cache.unlock(locked)
    assert cache.evict(100) == 3 and alloc.free_count == 1000


def test_eviction_frees_a_parent_after_its_last_child():
    cache, alloc = cache_with([1, 2, 3, 4], [1, 2, 5, 6])
    assert cache.evict(10) == 6
    assert cache.cached_sequences() == [] and alloc.free_count == 1000


def test_reset_returns_every_slot():
    cache, alloc = cache_with([1, 2, 3], [1, 4])
    cache.reset()
    assert alloc.free_count == 1000 and cache.total_size == 0
    assert cache.match_prefix([1, 2])[0] == []


def test_disabled_cache_never_matches_or_keeps_anything():
    alloc = TokenSlotAllocator(10)
    cache = RadixCache(alloc, disable=True)
    assert cache.insert([1, 2], alloc.alloc(2)) == 2  # the caller keeps (and frees) both
    assert cache.match_prefix([1, 2]) == ([], cache.root)
    assert cache.total_size == 0


class NaiveCache:
    """The reference: a dict from every cached prefix to the slot of its last token."""

    def __init__(self) -> None:
        self.slot_of: dict[tuple[int, ...], int] = {}

    def insert(self, seq: list[int], slots: list[int]) -> int:
        already = 0
        while already < len(seq) and tuple(seq[: already + 1]) in self.slot_of:
            already += 1
        for i in range(already, len(seq)):
            self.slot_of[tuple(seq[: i + 1])] = slots[i]
        return already

    def match(self, seq: list[int]) -> list[int]:
        out = []
        for i in range(len(seq)):
            slot = self.slot_of.get(tuple(seq[: i + 1]))
            if slot is None:
                break
            out.append(slot)
        return out


token_seqs = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(token_seqs, token_seqs)
def test_matches_the_naive_reference(inserts, queries):
    alloc = TokenSlotAllocator(1000)
    cache, naive = RadixCache(alloc), NaiveCache()
    for seq in inserts:
        slots = alloc.alloc(len(seq))
        dup = cache.insert(seq, slots)
        assert dup == naive.insert(seq, slots)
        alloc.free(slots[:dup])
        assert cache.total_size == len(naive.slot_of)
        assert alloc.free_count + cache.total_size == 1000
    for q in queries + inserts:
        assert cache.match_prefix(q)[0] == naive.match(q)
    assert cache.total_size == len(naive.slot_of)


@settings(max_examples=100, deadline=None)
@given(token_seqs, st.lists(st.integers(0, 24), max_size=5), st.integers(0, 60))
def test_eviction_keeps_locked_prefixes_and_conserves_slots(inserts, lock_picks, to_evict):
    cache, alloc = cache_with(*inserts)
    locked = []
    for pick in lock_picks:
        seq = inserts[pick % len(inserts)]
        slots, node = cache.match_prefix(seq)
        cache.lock(node)
        locked.append((seq, slots, node))
    before = cache.evictable_size
    freed = cache.evict(to_evict)
    assert freed >= min(to_evict, before)
    assert cache.evictable_size == before - freed
    assert alloc.free_count + cache.total_size == 1000
    for seq, slots, _ in locked:
        assert cache.match_prefix(seq)[0] == slots
    for _, _, node in locked:
        cache.unlock(node)
    assert cache.protected_size == 0
    cache.evict(10**6)
    assert cache.total_size == 0 and alloc.free_count == 1000


def test_a_cached_token_costs_the_tree_a_few_bytes():
    """The tree grows with what the KV pool holds (the soak's scheduler: ~190 more nodes a
    minute for half an hour): nodes keep tokens and slots as int32 arrays, 8 bytes a token
    plus the node's own, where lists of Python ints cost ~70 and kept every token id alive."""
    import random
    import tracemalloc

    allocator = TokenSlotAllocator(100_000)
    cache = RadixCache(allocator)
    rng = random.Random(0)
    shared = [rng.randrange(1000, 50_000) for _ in range(40)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(1000):
            tokens = shared[: rng.randrange(5, 40)]
            tokens += [rng.randrange(1000, 50_000) for _ in range(rng.randrange(10, 60))]
            slots = allocator.alloc(len(tokens))
            allocator.free(slots[: cache.insert(tokens, slots)])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.total_size > 30_000
    assert grown / cache.total_size < 24
