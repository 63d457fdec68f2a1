"""Prefill admission: which waiting requests join the next prefill batch, and how much of each.

Budgets (SGLang's): the KV the new tokens need plus their future output must fit in what is
free or evictable after reserving, for every running request, `new_token_ratio` of its
remaining output; a batch holds at most `max_prefill_tokens` new tokens; with chunked prefill
one request at a time may be cut into chunks of `chunked_prefill_size`.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from spectral.core.req import Req
from spectral.mem.radix_cache import common_prefix_len
from spectral.scheduler.kv_manager import KVManager

# Future output counted per request is capped, as in SGLang.
CLIP_MAX_NEW_TOKENS = 4096
# A waiting request that shares at least this many uncached tokens with one admitted in the
# same round waits a round, so that the first computes the shared part and the rest reuse it.
IN_BATCH_SHARED_PREFIX = 32
LPM_MAX_QUEUE = 128


class PrefillAdder:
    def __init__(
        self,
        kv: KVManager,
        running: list[Req],
        max_output: Callable[[Req], int],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        max_running_requests: int,
    ) -> None:
        self.kv = kv
        self.max_output = max_output
        reserved = sum(
            min(r.remaining_new_tokens(max_output(r)), CLIP_MAX_NEW_TOKENS) * new_token_ratio
            for r in running
        )
        self.rem_total = kv.available - reserved
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunked_prefill_size if chunked_prefill_size else None
        self.slots_left = max_running_requests - len(running)
        self.admitted: list[Req] = []
        self.new_chunked: Req | None = None

    def add_chunked(self, req: Req) -> None:
        """Continue the request being prefilled in chunks (it already holds its row and slots)."""
        remaining = len(req.all_ids) - req.seq_len
        self._take(req, req.seq_len, remaining)

    def try_add(self, req: Req) -> bool:
        """Admit `req` if the budgets allow; False means stop admitting this round."""
        if self.slots_left <= 0 or not self.kv.free_rows:
            return False
        if self.rem_chunk is not None and self.rem_chunk <= 0:
            return False
        tokens = req.all_ids
        cached, _ = self.kv.match(req, tokens)
        extend = len(tokens) - len(cached)
        future = min(req.remaining_new_tokens(self.max_output(req)), CLIP_MAX_NEW_TOKENS)
        if extend + future > self.rem_total:
            return False
        if self.admitted and extend > self.rem_input:
            return False
        prefix = self.kv.admit(req, tokens)
        needed = extend if self.rem_chunk is None else min(extend, self.rem_chunk)
        if self.kv.available < needed:
            # Locking the matched prefix took it out of what eviction can reclaim.
            self.kv.release(req)
            return False
        if req.retraction_count == 0 and not req.output_ids:
            req.cached_tokens = prefix
        self.rem_total -= future
        self._take(req, prefix, extend)
        self.slots_left -= 1
        return True

    def _take(self, req: Req, start: int, extend: int) -> None:
        if self.rem_chunk is not None and extend > self.rem_chunk:
            extend = self.rem_chunk
            self.new_chunked = req
        new_slots = self.kv.take(req, extend)
        req.kv_slots.extend(new_slots)
        req.extend_start, req.extend_len = start, extend
        self.rem_total -= extend
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend
        self.admitted.append(req)

    def shares_uncached_prefix(self, req: Req) -> bool:
        """Whether `req` would recompute a long prefix that a request admitted this round is
        computing right now (it should wait one round and reuse it from the tree)."""
        tokens = req.all_ids
        for other in self.admitted:
            shared = common_prefix_len(tokens, other.all_ids)
            if shared - other.extend_start >= IN_BATCH_SHARED_PREFIX:
                return True
        return False


def mix_running(running: list[Req], kv: KVManager) -> list[Req]:
    """The running requests that a prefill step decodes too (--enable-mixed-chunk): each its
    newest token, a slot taken for it as a decode step takes one; none where the pool cannot
    give every one a slot (the decode step after retracts as usual)."""
    if kv.available < len(running):
        return []
    for req in running:
        req.kv_slots.extend(kv.take(req, 1))
        req.extend_start, req.extend_len = req.seq_len - 1, 1
    return list(running)


def order_waiting(waiting: deque[Req], policy: str, kv: KVManager, running: list[Req]) -> list[Req]:
    """fcfs: arrival order. lpm: longest cached prefix first (fcfs for long queues). Either
    way fair between groups: a request whose group has fewer sequences running or queued
    ahead of it goes first, so one client's fan-out (a batch, n choices) takes turns with
    everyone else's requests instead of queueing them all behind it."""
    if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE and not kv.tree.disable:
        matched = {id(r): len(kv.tree.match_prefix(r.all_ids)[0]) for r in waiting}
        ordered = sorted(waiting, key=lambda r: -matched[id(r)])
    else:
        ordered = list(waiting)
    share = Counter(r.group_key for r in running)
    turn = {}
    for req in ordered:  # the k-th queued request of a group waits for its k-th turn
        turn[id(req)] = share[req.group_key]
        share[req.group_key] += 1
    return sorted(ordered, key=lambda r: turn[id(r)])


def fan_out_victim(running: list[Req], req: Req) -> Req | None:
    """Every row is taken and `req`'s group has none: the newest request of the group holding
    the most rows, if it holds at least two, to retract so that no client's fan-out keeps
    another client waiting for a whole generation. None: nothing to retract."""
    groups: dict[str, list[Req]] = {}
    for other in running:
        groups.setdefault(other.group_key, []).append(other)
    if req.group_key in groups:
        return None
    largest = max(groups.values(), key=len, default=[])
    if len(largest) < 2:
        return None
    return min(largest, key=lambda r: (len(r.output_ids), -r.created_at))
