"""The KV slot allocator against a naive model of ownership: the lowest free slots first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.mem import allocator
from spectral.mem.allocator import OutOfSlotsError, TokenSlotAllocator

NUM_SLOTS = 64

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 20)),
        st.tuples(st.just("free"), st.integers(0, 10)),
        st.tuples(st.just("free_many"), st.integers(0, 10)),
        st.tuples(st.just("snapshot_restore"), st.integers(0, 20)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_any_alloc_free_sequence_keeps_ownership_exact(sequence):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(allocator, "HEAPIFY_AT", 8)  # both ways of taking slots back
        check_sequence(sequence)


def check_sequence(sequence):
    alloc = TokenSlotAllocator(NUM_SLOTS)
    owned: list[list[int]] = []
    for op, n in sequence:
        held = {s for group in owned for s in group}
        if op == "alloc":
            if n > NUM_SLOTS - len(held):
                with pytest.raises(OutOfSlotsError):
                    alloc.alloc(n)
                continue
            free = sorted(set(range(1, NUM_SLOTS + 1)) - held)
            got = alloc.alloc(n)
            assert got == free[:n], "not the lowest free slots, in order"
            assert not held & set(got), "a slot was handed out twice"
            assert all(1 <= s <= NUM_SLOTS for s in got)
            owned.append(got)
        elif op == "free" and owned:
            alloc.free(owned.pop(n % len(owned)))
        elif op == "free_many" and owned:  # several groups at once, past HEAPIFY_AT
            groups = [owned.pop(i % len(owned)) for i in range(min(n, len(owned)))]
            alloc.free([s for group in groups for s in group])
        elif op == "snapshot_restore":
            state = alloc.snapshot()
            if n <= alloc.free_count:
                alloc.alloc(n)
            alloc.restore(state)
        held = {s for group in owned for s in group}
        assert alloc.free_count == NUM_SLOTS - len(held)
    for group in owned:
        alloc.free(group)
    assert alloc.free_count == NUM_SLOTS
    assert sorted(alloc.alloc(NUM_SLOTS)) == list(range(1, NUM_SLOTS + 1))


def test_double_free_is_refused():
    alloc = TokenSlotAllocator(4)
    slots = alloc.alloc(2)
    alloc.free(slots)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(slots[:1])


def test_dummy_slot_zero_is_never_handed_out_or_taken_back():
    alloc = TokenSlotAllocator(3)
    assert 0 not in alloc.alloc(3)
    with pytest.raises(ValueError, match="outside"):
        alloc.free([0])


def test_out_of_slots_names_the_shortfall():
    alloc = TokenSlotAllocator(3)
    with pytest.raises(OutOfSlotsError, match="asked for 4 KV slots, 3 free"):
        alloc.alloc(4)
