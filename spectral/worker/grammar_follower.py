"""The worker's side of structured outputs under speculation: its own matchers, advanced
along each request's committed output, and the compiles it reported ready to the scheduler."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future

from spectral.constrained import Grammar, GrammarBackend, MadeAhead, compiled_bytes

# Compiles reported ready kept for the requests about to follow them (beyond: looked up in
# the cache again, compiled again only where it let them go too).
READY_KEPT = 64


class GrammarFollower:
    """The worker's own matchers for the requests under a grammar, each advanced along the
    committed output the scheduler sends every step (the scheduler's matchers live in its
    process). A request seen again continues from where it was; one whose output no longer
    extends what was followed (a reused rid) starts over. The least recently seen requests are
    forgotten beyond `capacity` (followed again from the start if they come back)."""

    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        capacity: int = 1024,
        ready_capacity: int = READY_KEPT,
    ) -> None:
        self.backend = MadeAhead(make_backend)  # the server's worker starts it once ready
        self.capacity = capacity
        # rid -> (grammar kind and text, extra stop ids), matcher, output it has accepted
        self._followed: OrderedDict[str, tuple[tuple, Grammar, list[int]]] = OrderedDict()
        # The compiles reported ready, kept until a request follows them (the cache may let
        # them go meanwhile; compiling again would hold the whole server back).
        self._ready: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.ready_capacity = ready_capacity

    def ready(self, kind: str, text: str) -> bool:
        """Whether the grammar has compiled here (a failed compile counts: the scheduler refuses
        its requests); starts the compile where it has not."""
        compiled = self.backend.get().compile_later(kind, text)
        if not compiled.done():
            return False
        self._ready[(kind, text)] = compiled
        self._ready.move_to_end((kind, text))
        self._forget_ready()
        return True

    def _forget_ready(self) -> None:
        """Forget the oldest ready compiles beyond `ready_capacity`, or while those the cache
        itself let go hold more than its byte bound (a request may never come for one: it
        finished before a round, or its rounds were declined), the newest kept."""
        backend = self.backend.get()
        extra = sum(compiled_bytes(f) for key, f in self._ready.items() if not backend.holds(key))
        while len(self._ready) > 1 and (
            len(self._ready) > self.ready_capacity or extra > backend.cache_bytes
        ):
            key, future = self._ready.popitem(last=False)
            if not backend.holds(key):
                extra -= compiled_bytes(future)

    def retain(self, rids: Collection[str]) -> None:
        """Forget the matchers of requests other than `rids` (those of a round: the others
        have finished, or are followed again from the start when they come back). A kept
        matcher keeps its compiled grammar alive, past the cache's bound."""
        for rid in [rid for rid in self._followed if rid not in rids]:
            del self._followed[rid]

    def follow(
        self, rid: str, grammar: tuple[str, str], stop_ids: Sequence[int], output: list[int]
    ) -> Grammar:
        """The matcher of request `rid` after `output`."""
        key = (grammar, tuple(stop_ids))
        entry = self._followed.pop(rid, None)
        if entry is None or entry[0] != key or output[: len(entry[2])] != entry[2]:
            compiled = self._ready.pop(tuple(grammar), None)
            result = compiled.result() if compiled is not None else None
            entry = (key, self.backend.get().matcher(*grammar, stop_ids, result), [])
        _, matched, done = entry
        for token in output[len(done) :]:
            if not matched.accept(token):
                raise RuntimeError(f"token {token} does not continue the request's grammar")
        entry = (key, matched, list(output))
        self._followed[rid] = entry
        while len(self._followed) > self.capacity:
            self._followed.popitem(last=False)
        return matched
