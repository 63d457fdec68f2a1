"""NgramDrafter: model-free draft trees for speculative decoding, by n-gram lookup.

The suffix of a request's verified tokens (longest first, `max_ngram` down to `min_ngram`) is
matched against the request's own earlier tokens and a shared corpus of other sequences
(`add_sequence`); what followed each match goes into a trie weighted by the length matched,
and the tree grows best-first from it. The matching and weighting: docs/speculative.md.
"""

from __future__ import annotations

import heapq
import itertools
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from spectral.speculative.sources.datastore import Datastore
from spectral.speculative.sources.ngram_index import NgramIndex

MAX_MATCHES = 8
# Suffixes this short (or shorter) are matched only where no longer one was: their
# continuations beside a longer match's are its trie's least likely branches, and looking them
# up cost more than the rest of a proposal (one-token matches, NGRAM's default).
SHORTEST_ALONE = 1
# A datastore lookup (REST): the longest suffix it tries, and the occurrences it reads.
DATASTORE_WINDOW = 16
DATASTORE_RESULTS = 32
WEIGHT_BASE = 2 * MAX_MATCHES + 1
_INT32 = struct.Struct("=i")  # tokens are packed as native-order int32
_TOKEN_BYTES = _INT32.size


@dataclass
class NgramState:
    """One request's drafting state: its tokens packed as int32 for the byte search.

    Contract: pass it with the same request's context at every call; the context only grows
    (verified tokens are never taken back). A context shorter than the packing, or whose token at
    the packing's end differs, resets the state."""

    packed: bytearray = field(default_factory=bytearray)
    # Length of the longest suffix the last `propose` matched (0: none): a longer match is
    # followed by its continuation far more often, so the tree planner counts acceptance apart.
    match_len: int = 0
    # ... and of the one the datastore matched (0: none, or no datastore)
    retrieved_len: int = 0
    # the context's length at the last lookup, and the corpus's positions then (`reach`)
    looked_at: int = 0
    corpus_end: int = -1

    def sync(self, context: list[int]) -> bytearray:
        """Pack the tokens appended since the last call; return the whole packing."""
        packed = self.packed
        done = len(packed) // _TOKEN_BYTES
        if done > len(context) or (
            done and packed[-_TOKEN_BYTES:] != _INT32.pack(context[done - 1])
        ):
            packed.clear()
            done = 0
        new = context[done:]
        packed += struct.pack(f"={len(new)}i", *new)
        return packed


@dataclass
class NgramMatch:
    """A proposal's lookups (`NgramDrafter.match`), before its tree is built."""

    context: list[int]
    corpus_end: int  # the index's positions ever appended (the context ranks newer)
    # each occurrence whose continuation drafts: (its position, the weight of its match); a
    # position in the context as -1 - start, else the index's
    occurrences: list[tuple[int, int]] = field(default_factory=list)
    longest: int = 0  # the longest suffix matched (0: none)
    retrieved: list[list[int]] = field(default_factory=list)  # the datastore's continuations
    retrieved_len: int = 0  # ... and the length of suffix it matched

    @property
    def has_continuations(self) -> bool:
        return bool(self.occurrences or self.retrieved)


class _TrieNode:
    __slots__ = ("weight", "recency", "children")

    def __init__(self, recency: int) -> None:
        self.weight = 0
        self.recency = recency
        self.children: dict[int, _TrieNode] = {}

    def add_path(self, tokens: list[int], weight: int, recency: int) -> None:
        """Count `tokens` as one continuation below this node, with `weight`."""
        node = self
        node.weight += weight
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _TrieNode(recency)
            child.weight += weight
            if recency > child.recency:
                child.recency = recency
            node = child


class NgramDrafter:
    """Drafts n-gram trees for the scheduler's requests from their own tokens and a shared
    corpus; not thread-safe (one scheduler owns it)."""

    def __init__(
        self,
        max_nodes: int,
        max_depth: int,
        min_ngram: int = 1,
        max_ngram: int = 4,
        max_indexed_tokens: int = 1_000_000,
        datastore: Datastore | None = None,
        ngrams: bool = True,
        shortest_alone: int = SHORTEST_ALONE,
    ) -> None:
        """`datastore`: a corpus whose continuations draft where no n-gram matches (REST);
        `ngrams` False: the datastore's alone (no matches in the context or the server's past
        requests); `shortest_alone`: suffixes this short are matched only where no longer one
        was (0: beside longer ones too)."""
        if max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0 (got {max_nodes})")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1 (got {max_depth})")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram (got min_ngram={min_ngram}, "
                f"max_ngram={max_ngram})"
            )
        if max_indexed_tokens < 0:
            raise ValueError(f"max_indexed_tokens must be >= 0 (got {max_indexed_tokens})")
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_indexed_tokens = max_indexed_tokens
        self.ngrams = ngrams
        self.index = NgramIndex(max_indexed_tokens if ngrams else 0, min_ngram, max_ngram)
        self.datastore = datastore
        self.shortest_alone = shortest_alone

    @property
    def num_indexed_tokens(self) -> int:
        return self.index.num_tokens

    def clear(self) -> None:
        """Forget every sequence added (a flushed cache)."""
        self.index.clear()

    def add_sequence(self, tokens: list[int]) -> None:
        """Index a sequence (e.g. a finished request's prompt + output) for other requests to
        match. Only its last `max_indexed_tokens` tokens are kept; the oldest sequences are
        evicted to make room."""
        self.index.add(tokens)

    def propose(
        self, context: list[int], state: NgramState | None = None
    ) -> tuple[list[int], list[int]]:
        """(node_tokens, node_parents) for the non-root nodes of a draft tree below
        `context[-1]` in `trees_from_parents`' form (parents first; 0 is the root), at most
        `max_nodes` nodes and `max_depth` deep, siblings distinct; ([], []) when nothing
        matches. `state` (see NgramState) spares packing the whole context again."""
        return self.tree(self.match(context, state))

    def match(self, context: list[int], state: NgramState | None = None) -> NgramMatch:
        """`propose`'s lookups alone: the occurrences whose continuations its tree would
        hold, and the lengths matched (set on `state` too). The tree (`tree`) costs as much
        again, and where the planner declines to verify it, nothing needs it."""
        found = NgramMatch(context, self.index.total)
        if not context or self.max_nodes == 0:
            return found
        # the packed context serves the context's own matches only (none for REST alone)
        data = (state if state is not None else NgramState()).sync(context) if self.ngrams else b""
        # Occurrences seen: the corpus's by position, the context's own as -1 - start.
        seen: set[int] = set()
        longest = 0
        top = min(self.max_ngram, len(context)) if self.ngrams else 0
        for n in range(top, self.min_ngram - 1, -1):
            if longest and n <= self.shortest_alone:
                break
            weight = WEIGHT_BASE**n
            matched = len(seen)
            for start in _self_matches(data, n):
                if -1 - start not in seen:
                    seen.add(-1 - start)
                    found.occurrences.append((-1 - start, weight))
            for start in self.index.matches(context[-n:], MAX_MATCHES):
                if start not in seen:
                    seen.add(start)
                    found.occurrences.append((start, weight))
            if len(seen) > matched and not longest:
                longest = n
            if len(seen) >= MAX_MATCHES:
                break
        found.longest = longest
        if not longest:
            self._retrieve(context, found)
        if state is not None:
            state.match_len, state.retrieved_len = found.longest, found.retrieved_len
            state.looked_at, state.corpus_end = len(context), found.corpus_end
        return found

    def reach(self, context_len: int, state: NgramState) -> int | None:
        """The longest suffix a lookup could match now in a context of `context_len` tokens,
        from the state's last lookup: a match grows by at most one token a token (its prefix
        matched before, unless shorter than the lengths looked up). None where that is not
        known: no lookup yet, the corpus grown since, or a datastore (its matches are of
        other lengths)."""
        if state.corpus_end != self.index.total or self.datastore is not None:
            return None
        grown = context_len - state.looked_at
        return min(self.max_ngram, max(state.match_len, self.min_ngram - 1) + grown)

    def most_nodes(self, found: NgramMatch) -> int:
        """The most nodes `tree(found)` can have: what the planner sizes before it is built."""
        paths = len(found.occurrences) + len(found.retrieved)
        return min(self.max_nodes, paths * self.max_depth)

    def tree(self, found: NgramMatch) -> tuple[list[int], list[int]]:
        """`propose`'s tree from its lookups (`match`): what followed each occurrence in a
        trie weighted by the length matched, the context ranking newer than the whole corpus
        (recency past its last position), the datastore's continuations counted once each."""
        root = _TrieNode(0)
        context, depth = found.context, self.max_depth
        for position, weight in found.occurrences:
            if position < 0:
                start = -1 - position
                root.add_path(context[start : start + depth], weight, found.corpus_end + start)
            else:
                root.add_path(self.index.continuation(position, depth), weight, position)
        for k, cont in enumerate(found.retrieved):
            root.add_path(cont, 1, -1 - k)
        return self._best_first(root)

    def _retrieve(self, context: list[int], found: NgramMatch) -> None:
        """The datastore's continuations of the context's longest suffix it holds (the trie
        will hold nothing else, so a node's probability is the share of continuations through
        it), and the length matched. Asked only where the context and the server's past
        requests matched nothing: their own n-grams draft better (beside them, the standard
        library's continuations took HumanEval's accept length on the 1.5B from 2.59 to
        2.16)."""
        if self.datastore is None:
            return
        lookup = self.datastore.lookup(
            context, DATASTORE_WINDOW, DATASTORE_RESULTS, self.max_depth, self.min_ngram
        )
        if lookup.continuations:
            found.retrieved = list(lookup.continuations)
            found.retrieved_len = lookup.match_len

    def _best_first(self, root: _TrieNode) -> tuple[list[int], list[int]]:
        """The `max_nodes` most probable trie nodes, each emitted after its parent."""
        tokens: list[int] = []
        parents: list[int] = []
        tiebreak = itertools.count()
        heap: list[tuple[float, int, int, int, _TrieNode, int]] = []
        node, prob, index = root, 1.0, 0
        while True:
            for token, child in node.children.items():
                entry = (-prob * child.weight / node.weight, -child.recency, next(tiebreak))
                heapq.heappush(heap, (*entry, token, child, index))
            if not heap or len(tokens) == self.max_nodes:
                return tokens, parents
            neg_prob, _, _, token, node, parent = heapq.heappop(heap)
            prob = -neg_prob
            tokens.append(token)
            parents.append(parent)
            index = len(tokens)


def _self_matches(data: bytearray, n: int) -> Iterator[int]:
    """Continuation starts (token positions) of the MAX_MATCHES most recent occurrences of the
    last `n` tokens of `data` (int32 tokens) that end before its last token, newest first."""
    size = _TOKEN_BYTES
    pattern = data[-n * size :]
    end = len(data) - size
    found = 0
    while found < MAX_MATCHES:
        pos = data.rfind(pattern, 0, end)
        if pos < 0:
            return
        end = pos + len(pattern) - 1
        if pos % size == 0:
            found += 1
            yield pos // size + n
