"""RadixCache: a compressed trie over token ids whose nodes hold the KV slots of those tokens.

Ownership: a slot inserted into the tree belongs to the tree until it is evicted (then it goes
back to the allocator) or the tree is reset. A locked node and its ancestors are *protected*
(never evicted); every other cached token is *evictable*. Callers lock what they read.

A node keeps its tokens and slots as int32 arrays (8 bytes a cached token, against ~72 as lists
of Python ints): the tree grows with what the KV pool holds, up to its size.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from dataclasses import dataclass, field

from spectral.mem.allocator import TokenSlotAllocator

_clock = itertools.count()


def int32s(values: object = ()) -> array:
    return array("i", values)


@dataclass(eq=False, slots=True)
class TreeNode:
    key: array = field(default_factory=int32s)
    value: array = field(default_factory=int32s)  # one KV slot per token of `key`
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def touch(self) -> None:
        self.last_access = next(_clock)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: TokenSlotAllocator, disable: bool = False) -> None:
        self.allocator = allocator
        self.disable = disable
        self.reset()

    def reset(self) -> None:
        """Forget every cached token, giving its slots back to the allocator. Locks are lost:
        call only when no request holds a node."""
        if getattr(self, "root", None) is not None:
            for node in self._all_nodes():
                if node is not self.root and node.value:
                    self.allocator.free(node.value)
        self.root = TreeNode(lock_ref=1)
        self.evictable_size = 0
        self.protected_size = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---- lookup and insertion ----------------------------------------------------------------

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """Slots of the longest cached prefix of `tokens`, and the node where it ends (split so
        the match ends exactly at a node). Does not lock: the caller locks what it keeps."""
        if self.disable:
            return [], self.root
        node, slots, pos = self.root, [], 0
        node.touch()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, tokens[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.touch()
            slots.extend(child.value)
            pos += n
            node = child
        return slots, node

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Cache `tokens` with their `slots`. Returns how many leading tokens were cached
        already: the tree keeps its own slots for those, and the caller still owns (and must
        free) whichever of `slots[:returned]` are not the tree's. Every slot after that is
        handed to the tree. A disabled cache takes nothing: it returns len(tokens)."""
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        if self.disable:
            return len(tokens)
        node, pos = self.root, 0
        node.touch()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = TreeNode(key=int32s(tokens[pos:]), value=int32s(slots[pos:]), parent=node)
                leaf.touch()
                node.children[tokens[pos]] = leaf
                self.evictable_size += len(leaf.key)
                return pos
            n = common_prefix_len(child.key, tokens[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.touch()
            pos += n
            node = child
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens; returns the new upper node (same lock count)."""
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n],
            parent=child.parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        assert child.parent is not None
        child.parent.children[child.key[0]] = upper
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # ---- locking -----------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction until a matching `unlock`."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            if node.lock_ref <= 0:
                raise RuntimeError("unlock without a matching lock")
            node.lock_ref -= 1
            assert node.parent is not None
            node = node.parent

    # ---- eviction ----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (if that many are evictable), least recently used
        unlocked leaves first. Returns how many were freed."""
        if num_tokens <= 0:
            return 0
        leaves = [n for n in self._all_nodes() if self._evictable_leaf(n)]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            if self._evictable_leaf(parent):
                heapq.heappush(leaves, parent)
        return freed

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _all_nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def cached_sequences(self) -> list[list[int]]:
        """Every root-to-leaf token sequence (for tests and debugging)."""
        out: list[list[int]] = []

        def walk(node: TreeNode, prefix: list[int]) -> None:
            seq = prefix + node.key.tolist()
            if not node.children and node is not self.root:
                out.append(seq)
            for child in node.children.values():
                walk(child, seq)

        walk(self.root, [])
        return out
