"""NgramIndex: the n-gram drafter's corpus in arrays of a fixed size, allocated and written once.

Sequences are appended to a ring of int32 tokens whose length is the bound (`max_tokens`); a
position is absolute (it only grows), its slot is `position % max_tokens`. For each n-gram
length, every continuation start `p` (the n tokens before it being the n-gram) is linked into a
hash chain, as LZ77 compressors find earlier matches: `heads[n][bucket]` holds the newest start
whose n-gram hashes to `bucket`, `links[n][p % max_tokens]` the distance back to the previous one
in that bucket. A lookup walks the chain newest first, checks each candidate's tokens (buckets
are shared by unrelated n-grams) and stops at the first position no longer kept. Sequences leave
whole, oldest first, when a new one needs their room; a flush forgets them all by moving the
start of what is kept. Nothing grows after construction: the index's memory is claimed at once
(`nbytes`), a few dozen bytes a token where a dict of tuples took about a kilobyte.
"""

from __future__ import annotations

import bisect

import numpy as np

# Multiplier of the polynomial hash over an n-gram's tokens and the mixing constant applied to
# it (both odd, 64-bit); the bucket is the mixed hash's top bits.
_HASH_MULT = 0x9E3779B97F4A7C15
_HASH_MIX = 0xBF58476D1CE4E5B9
_MASK = (1 << 64) - 1
# Chain steps a lookup takes at most: enough for every kept occurrence it wants plus the
# collisions of a half-full table, and a bound on the work of one that is all collisions.
MAX_CHAIN_STEPS = 256
# A sequence this short (LOOKAHEAD's pool n-grams, a few tokens each) is linked in Python: NumPy's
# cost a call is most of the work of a few tokens.
SHORT_SEQUENCE = 32


def _bucket_bits(max_tokens: int) -> int:
    """Buckets per n-gram length: about half a bucket per kept token (at least 16)."""
    return max(4, (max(1, max_tokens) - 1).bit_length() - 1)


class NgramIndex:
    """The most recent occurrences of each n-gram (n in min_n..max_n) among the kept sequences,
    and what followed them. Not thread-safe."""

    def __init__(self, max_tokens: int, min_n: int, max_n: int, bucket_bits: int | None = None):
        self.max_tokens = max_tokens
        self.min_n, self.max_n = min_n, max_n
        self.bits = _bucket_bits(max_tokens) if bucket_bits is None else bucket_bits
        ring = max(1, max_tokens)
        lengths = max_n - min_n + 1
        # Written in full here (np.zeros would leave the pages to the first write), so that
        # every page is resident from the start.
        self._tokens = np.full(ring, 0, dtype=np.int32)
        self._links = np.full((lengths, ring), 0, dtype=np.int32)  # 0: no earlier one
        self._heads = np.full((lengths, 1 << self.bits), -1, dtype=np.int64)
        # The same memory for lookups: a memoryview reads one element several times faster.
        self._token_view = memoryview(self._tokens)
        self._link_views = [memoryview(row) for row in self._links]
        self._head_views = [memoryview(row) for row in self._heads]
        self._total = 0  # positions ever appended
        self._kept_from = 0  # the first position still kept
        self._starts: list[int] = []  # each kept (or evicted, before `_first`) sequence's start
        self._ends: list[int] = []
        self._first = 0  # index in `_starts` of the oldest kept sequence

    @property
    def nbytes(self) -> int:
        return self._tokens.nbytes + self._links.nbytes + self._heads.nbytes

    @property
    def total(self) -> int:
        """Positions ever appended (the next sequence's start)."""
        return self._total

    @property
    def num_tokens(self) -> int:
        return self._total - self._kept_from

    def clear(self) -> None:
        """Forget every sequence (the arrays stay; what they hold is no longer kept)."""
        self._kept_from = self._total
        self._starts, self._ends, self._first = [], [], 0

    def add(self, tokens: list[int]) -> None:
        """Keep `tokens` (their last `max_tokens`), evicting the oldest sequences to make room;
        a sequence too short to have an n-gram with a continuation is not kept."""
        tokens = tokens[max(0, len(tokens) - self.max_tokens) :]
        if len(tokens) <= self.min_n:
            return
        while self.num_tokens + len(tokens) > self.max_tokens:
            self._first += 1
            kept = self._first < len(self._starts)
            self._kept_from = self._starts[self._first] if kept else self._total
        if self._first > 64 and self._first * 2 > len(self._starts):
            del self._starts[: self._first], self._ends[: self._first]
            self._first = 0
        start, size = self._total, self.max_tokens
        if len(tokens) <= SHORT_SEQUENCE:
            self._add_short(tokens, start)
        else:
            arr = np.asarray(tokens, dtype=np.int64)
            positions = np.arange(start, start + len(arr), dtype=np.int64)
            slots = positions % size
            self._tokens[slots] = arr
            for n in range(self.min_n, min(self.max_n, len(arr) - 1) + 1):
                self._link(n, arr, positions[n:], slots[n:])
        self._starts.append(start)
        self._ends.append(start + len(tokens))
        self._total += len(tokens)

    def _add_short(self, tokens: list[int], start: int) -> None:
        """`add`'s writes for a short sequence, token by token (`_link`'s chains, built in
        position order: the same arrays)."""
        size = self.max_tokens
        for i, token in enumerate(tokens):
            self._token_view[(start + i) % size] = token
        for n in range(self.min_n, min(self.max_n, len(tokens) - 1) + 1):
            heads, links = self._head_views[n - self.min_n], self._link_views[n - self.min_n]
            for i in range(n, len(tokens)):
                p = start + i
                bucket = self.bucket(tokens[i - n : i])
                before = heads[bucket]
                links[p % size] = p - before if before >= 0 and p - before < size else 0
                heads[bucket] = p

    def _link(self, n: int, arr: np.ndarray, starts: np.ndarray, slots: np.ndarray) -> None:
        """Put each continuation start of `arr` after an n-gram at the head of its chain."""
        buckets = self._buckets(n, arr)
        heads, links = self._heads[n - self.min_n], self._links[n - self.min_n]
        order = np.argsort(buckets, kind="stable")  # within a bucket, oldest first
        b, p = buckets[order], starts[order]
        new_bucket = np.ones(len(b), dtype=bool)
        new_bucket[1:] = b[1:] != b[:-1]
        before = np.empty_like(p)
        before[1:] = p[:-1]
        before[new_bucket] = heads[b[new_bucket]]
        # A distance of 0 ends the chain: none before, or one beyond the ring's reach.
        distance = np.where((before >= 0) & (p - before < self.max_tokens), p - before, 0)
        links[slots[order]] = distance
        last = np.ones(len(b), dtype=bool)
        last[:-1] = new_bucket[1:]
        heads[b[last]] = p[last]

    def _buckets(self, n: int, arr: np.ndarray) -> np.ndarray:
        """The bucket of every n-gram of `arr` that has a continuation (by its start)."""
        h = np.zeros(len(arr) - n, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i in range(n):
                h = h * np.uint64(_HASH_MULT) + arr[i : len(arr) - n + i].astype(np.uint64)
            h = (h ^ (h >> np.uint64(29))) * np.uint64(_HASH_MIX)
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def bucket(self, ngram: list[int]) -> int:
        """What `_buckets` gives for `ngram` (Python integers, the same arithmetic)."""
        h = 0
        for token in ngram:
            h = (h * _HASH_MULT + (token & _MASK)) & _MASK
        h = ((h ^ (h >> 29)) * _HASH_MIX) & _MASK
        return h >> (64 - self.bits)

    def matches(self, ngram: list[int], limit: int) -> list[int]:
        """Continuation starts of the `limit` newest kept occurrences of `ngram`, newest first
        (each an absolute position; `continuation` reads what follows)."""
        n = len(ngram)
        if not self.min_n <= n <= self.max_n or self.num_tokens == 0:
            return []
        links, tokens = self._link_views[n - self.min_n], self._token_view
        size, kept_from = self.max_tokens, self._kept_from
        p = self._head_views[n - self.min_n][self.bucket(ngram)]
        found: list[int] = []
        for _ in range(MAX_CHAIN_STEPS):
            if p < kept_from:
                break
            slot = p % size
            if slot >= n:  # the n-gram's tokens, read in place
                if tokens[slot - n : slot].tolist() == ngram:
                    found.append(p)
            elif self._read(p - n, p) == ngram:
                found.append(p)
            if len(found) == limit:
                break
            distance = links[slot]
            if distance == 0:
                break
            p -= distance
        return found

    def continuation(self, position: int, length: int) -> list[int]:
        """Up to `length` tokens from `position` to the end of its sequence."""
        end = min(position + length, self._sequence(position)[1])
        return self._read(position, end)

    def _sequence(self, position: int) -> tuple[int, int]:
        """(start, end) of the kept sequence holding `position`."""
        i = bisect.bisect_right(self._starts, position, lo=self._first) - 1
        return self._starts[i], self._ends[i]

    def _read(self, begin: int, end: int) -> list[int]:
        size = self.max_tokens
        a, b = begin % size, (end - 1) % size + 1
        if end <= begin:
            return []
        if a < b:
            return self._token_view[a:b].tolist()
        return self._token_view[a:].tolist() + self._token_view[:b].tolist()
