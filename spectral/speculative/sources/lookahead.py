"""LOOKAHEAD: Jacobi decoding with an n-gram pool (after LADE), no draft model.

Each request keeps a window of W guessed tokens for the positions after its root and a pool of
n-grams (N tokens: the first one a key, the other N - 1 a continuation; the G most recent a key).
A round verifies, in the one target forward of every round and under its tree mask, two
branches below the root:

- verification: the pool's continuations of the root (up to G chains of N - 1 tokens);
- lookahead: the window, as one chain.

The target's greedy choice after every node of the lookahead chain then feeds both: each chain
node with the N - 2 tokens before it along the chain and the choice after it is an n-gram for the
pool (LADE's trajectory, two Jacobi iterations deep), and the choices past the round's accepted
length are the next window (Jacobi's update: each guess replaced by what the target predicts
there given the guesses before it). Verification is every drafter's (greedy by argmax, sampling
by the lossless rejection rule), so the output is plain decoding's; a lookahead guess that is
right is accepted like any draft.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from spectral.speculative.tree import merge_tree_nodes


@dataclass
class LookaheadState:
    """One request's window (guesses for the positions after its root) and n-gram pool; and the
    last tree's lookahead nodes (their indices among its non-root nodes, chain order)."""

    window: list[int] = field(default_factory=list)
    pool: dict[int, OrderedDict[tuple[int, ...], None]] = field(default_factory=dict)
    chain_nodes: list[int] = field(default_factory=list)
    root: int = -1  # the last tree's root token


class LookaheadDrafter:
    def __init__(self, window: int, ngram: int, guesses: int) -> None:
        """W >= 1, N >= 2, G >= 0 (SpecSettings checks the flags)."""
        self.window = window
        self.ngram = ngram
        self.guesses = guesses

    @property
    def most_nodes(self) -> int:
        """The most nodes `propose` adds to a given tree: the pool's chains and the window."""
        return self.guesses * (self.ngram - 1) + self.window

    def propose(
        self,
        context: list[int],
        state: LookaheadState,
        tokens: list[int] | None = None,
        parents: list[int] | None = None,
    ) -> tuple[list[int], list[int]]:
        """The tree below the root (`context[-1]`), in `trees_from_parents`' node form: the
        given one (`tokens`, `parents`: the n-gram drafter's), then the pool's continuations of
        the root, then the window as a chain; notes where the chain's nodes are
        (`state.chain_nodes`)."""
        root = context[-1]
        if len(state.window) < self.window:  # a new request: guess the context's own tokens
            tail = context[-self.window :]
            state.window = (state.window + tail * self.window)[: self.window]
        state.root = root
        tokens, parents = list(tokens or []), list(parents or [])
        for continuation in list(reversed(state.pool.get(root, {})))[: self.guesses]:
            chain = list(range(len(continuation)))  # the newest first
            tokens, parents = merge_tree_nodes(tokens, parents, list(continuation), chain)
        chain = list(range(self.window))
        tokens, parents = merge_tree_nodes(tokens, parents, state.window, chain)
        state.chain_nodes = self._chain_nodes(tokens, parents, state.window)
        return tokens, parents

    @staticmethod
    def _chain_nodes(tokens: list[int], parents: list[int], window: list[int]) -> list[int]:
        """The non-root node indices of the path that spells `window` from the root."""
        nodes: list[int] = []
        at = 0  # the root
        for guess in window:
            child = next(
                (i for i, (t, p) in enumerate(zip(tokens, parents)) if p == at and t == guess),
                None,
            )
            if child is None:
                break
            nodes.append(child)
            at = child + 1
        return nodes

    def observe(
        self, state: LookaheadState, node_next: list[int], verified: int, accepted: int
    ) -> list[list[int]]:
        """A verified round of `verified` non-root nodes: `node_next[j]` is the target's greedy
        choice after node j (0 the root, j + 1 non-root node j) and `accepted` the tokens the
        round emitted. The pool learns the chain's n-grams (returned, for the n-gram drafter's
        corpus too); the window moves past them."""
        nodes = [n for n in state.chain_nodes if n < verified]
        if not nodes:
            return []
        path = [state.root] + [
            state.window[i] for i in range(len(nodes))
        ]  # chain tokens, root first
        after = [node_next[0]] + [node_next[n + 1] for n in nodes]  # the choice after each
        grams = [
            path[j - self.ngram + 2 : j + 1] + [after[j]] for j in range(self.ngram - 2, len(path))
        ]
        for gram in grams:
            self._remember(state, gram)
        # Jacobi: the guess for position root + k is what the target chose after chain node
        # k - 1; the new root sits `accepted` positions on.
        moved = after[accepted:]  # the old guesses top it up to W (`propose` made the window W)
        state.window = (moved + state.window[len(moved) :])[: self.window]
        return grams

    def _remember(self, state: LookaheadState, gram: list[int]) -> None:
        grams = state.pool.setdefault(gram[0], OrderedDict())
        key = tuple(gram[1:])
        grams.pop(key, None)
        grams[key] = None  # the newest last
        while len(grams) > self.guesses:
            grams.popitem(last=False)
