"""NgramIndex (the n-gram drafter's corpus in fixed arrays) against a naive reference: the
occurrences it finds, newest first, what follows them, whole-sequence eviction; and its memory,
claimed at construction and flat however much is added."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spectral.speculative.sources.ngram_index import NgramIndex


class NaiveIndex:
    """The kept sequences as lists (absolute starts), searched by scanning."""

    def __init__(self, max_tokens: int, min_n: int) -> None:
        self.max_tokens, self.min_n = max_tokens, min_n
        self.seqs: list[tuple[int, list[int]]] = []
        self.total = 0

    def add(self, tokens: list[int]) -> None:
        tokens = tokens[max(0, len(tokens) - self.max_tokens) :]
        if len(tokens) <= self.min_n:
            return
        while sum(len(t) for _, t in self.seqs) + len(tokens) > self.max_tokens:
            self.seqs.pop(0)
        self.seqs.append((self.total, tokens))
        self.total += len(tokens)

    def clear(self) -> None:
        self.seqs = []

    def matches(self, ngram: list[int], limit: int) -> list[int]:
        n, found = len(ngram), []
        for start, tokens in reversed(self.seqs):
            for p in range(len(tokens) - 1, n - 1, -1):
                if tokens[p - n : p] == ngram and len(found) < limit:
                    found.append(start + p)
        return found

    def continuation(self, position: int, length: int) -> list[int]:
        for start, tokens in self.seqs:
            if start <= position < start + len(tokens):
                return tokens[position - start : position - start + length]
        raise AssertionError(f"position {position} is not kept")


ops = st.lists(st.one_of(st.lists(st.integers(0, 3), max_size=14), st.just("clear")), max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    cap=st.integers(0, 30),
    min_n=st.integers(1, 2),
    extra=st.integers(0, 2),
    bits=st.integers(0, 3),
    queries=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6),
)
def test_lookups_find_what_a_scan_of_the_kept_sequences_finds(
    ops, cap, min_n, extra, bits, queries
):
    # 1 to 8 buckets: n-grams of 4 tokens collide all the time, so every chain is shared.
    index = NgramIndex(cap, min_n, min_n + extra, bucket_bits=bits)
    naive = NaiveIndex(cap, min_n)
    for op in ops:
        if op == "clear":
            index.clear()
            naive.clear()
        else:
            index.add(op)
            naive.add(op)
        assert index.num_tokens == sum(len(t) for _, t in naive.seqs)
    for ngram in queries:
        if not min_n <= len(ngram) <= min_n + extra:
            assert index.matches(ngram, 8) == []
            continue
        for limit in (1, 3, 8):
            found = index.matches(ngram, limit)
            assert found == naive.matches(ngram, limit)
            for p in found:
                assert index.continuation(p, 3) == naive.continuation(p, 3)


def test_hash_buckets_agree_between_the_array_and_the_scalar_arithmetic():
    index = NgramIndex(1000, 1, 4)
    tokens = [0, 1, 49151, 151645, 2**31 - 1, 7, 7, 7]
    for n in range(1, 5):
        vector = index._buckets(n, np.asarray(tokens, dtype=np.int64))
        assert vector.tolist() == [index.bucket(tokens[i : i + n]) for i in range(len(tokens) - n)]


RESIDENT = """
import json, os, numpy as np
from spectral.speculative.sources.ngram_index import NgramIndex

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident()
lazy = np.zeros(9_000_000 * 4, dtype=np.int32)  # the control: calloc'ed, pages untouched
mid = resident()
index = NgramIndex(9_000_000, 1, 1)
print(json.dumps([mid - before, lazy.nbytes, resident() - mid, index.nbytes]))
"""


def test_the_index_is_resident_from_construction():
    """In a fresh process (a test process's heap may hold freed pages already resident): the
    index's arrays (9M tokens of one n-gram length, 36-64 MiB each) are resident once built,
    where zeros that no one wrote are not."""
    out = subprocess.run(
        [sys.executable, "-c", RESIDENT], capture_output=True, text=True, check=True
    ).stdout
    lazy_grown, lazy_bytes, grown, nbytes = json.loads(out)
    assert lazy_grown < 0.05 * lazy_bytes
    assert grown >= 0.95 * nbytes
    assert nbytes < 16 * 9_000_000  # 4 B of token, 4 of link, <= 8 of head a token


def test_memory_stays_flat_however_much_is_added():
    index = NgramIndex(50_000, 1, 4)
    seq = list(range(100))
    tracemalloc.start()
    try:
        for i in range(1000):  # fills the index (500 sequences), then evicts as many
            index.add([(t * 7 + i) % 5000 for t in seq])
        held = tracemalloc.get_traced_memory()[0]
        for i in range(3000):  # six more fillings: what the index keeps of them is its own
            index.add([(t * 7 + i) % 5000 for t in seq])
        grown = tracemalloc.get_traced_memory()[0] - held
    finally:
        tracemalloc.stop()
    assert index.num_tokens == 50_000
    assert grown < 64 * 1024, f"the index grew by {grown} bytes once full"


def test_short_sequences_linked_in_python_give_numpys_arrays(monkeypatch):
    """`add`'s two ways of writing a sequence (NumPy, and token by token for short ones) leave
    the same tokens, chains and heads, over sequences of every length around the threshold,
    evictions and wrap-around included."""
    import spectral.speculative.sources.ngram_index as module

    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 6, size=int(rng.integers(0, 70))).tolist() for _ in range(120)]
    indexes = []
    for short in (0, module.SHORT_SEQUENCE):
        monkeypatch.setattr(module, "SHORT_SEQUENCE", short)
        index = NgramIndex(max_tokens=500, min_n=1, max_n=4, bucket_bits=5)
        for tokens in sequences:
            index.add(tokens)
        indexes.append(index)
    numpy_path, python_path = indexes
    assert np.array_equal(numpy_path._tokens, python_path._tokens)
    assert np.array_equal(numpy_path._links, python_path._links)
    assert np.array_equal(numpy_path._heads, python_path._heads)
    assert numpy_path.total == python_path.total > 500
