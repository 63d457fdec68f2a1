"""ScheduleBatch: the requests of one step and how they become a `WorkerBatch`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from spectral.constrained import allocate_bitmask
from spectral.core.forward import ForwardMode
from spectral.core.req import Req
from spectral.core.worker_io import RequestSampling, WorkerBatch


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    # running requests decoding their newest token in a prefill step (--enable-mixed-chunk)
    decoding: frozenset[str] = frozenset()

    @classmethod
    def prefill(cls, admitted: list[Req], decoding: list[Req]) -> ScheduleBatch:
        """A prefill step of the `admitted` requests' prompts (chunks), with `decoding` running
        requests' newest tokens."""
        return cls(ForwardMode.EXTEND, admitted + decoding, frozenset(r.rid for r in decoding))

    def prefills(self, req: Req) -> bool:
        """Whether the batch computes part of `req`'s prompt (not a decode's newest token)."""
        return self.mode == ForwardMode.EXTEND and req.rid not in self.decoding

    def new_token_range(self, req: Req) -> tuple[int, int]:
        """[start, end) of the positions this batch computes for `req`."""
        if self.mode == ForwardMode.EXTEND:
            return req.extend_start, req.extend_start + req.extend_len
        return req.seq_len - 1, req.seq_len

    def completes_prefill(self, req: Req) -> bool:
        """Whether this forward reaches the request's last token (its logits are wanted)."""
        return self.new_token_range(req)[1] == req.num_ids

    def to_worker_batch(
        self, banned_for: dict[str, list[int]], draft_next: bool = False
    ) -> WorkerBatch:
        """The new tokens of every request (their slots already in `req.kv_slots`), plus the
        table rows the worker has not seen yet. With `draft_next` (a draft head runs after an
        EXTEND), the token after each request's last new position where it is known."""
        if self.mode == ForwardMode.TARGET_VERIFY:
            return self._verify_batch(banned_for)
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        table_writes: list[tuple[int, int, list[int]]] = []
        sampling: list[RequestSampling] = []
        logprob_starts: list[int] = []
        logprob_next: list[int] = []
        for req in self.reqs:
            start, end = self.new_token_range(req)
            input_ids.extend(req.token_slice(start, end))
            positions.extend(range(start, end))
            out_loc.extend(req.kv_slots[start:end])
            prefix_lens.append(start)
            extend_lens.append(end - start)
            n = len(req.input_ids)
            wanted = self.prefills(req) and req.wants_input_logprobs
            first = max(min(req.logprob_start_len, n - 1), start)
            last_row = min(end, n - 1) - 1  # rows score the token after them, inside the prompt
            logprob_starts.append(first if wanted and first <= last_row else -1)
            logprob_next.append(req.input_ids[end] if wanted and end < n else -1)
            stale = req.table_stale_from
            if stale is not None and stale < start:
                table_writes.append((req.req_pool_idx, stale, req.kv_slots[stale:start]))
            req.table_stale_from = None
            sampling.append(self._sampling(req, banned_for))
        return WorkerBatch(
            mode=self.mode,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_loc,
            req_pool_indices=[req.req_pool_idx for req in self.reqs],
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            sampling=sampling,
            table_writes=table_writes,
            input_logprob_starts=logprob_starts if any(s >= 0 for s in logprob_starts) else [],
            input_logprob_next=logprob_next if any(s >= 0 for s in logprob_starts) else [],
            draft_next_ids=self._draft_next_ids() if draft_next else [],
            vocab_mask=self._vocab_mask(),
        )

    def to_follow_batch(self, rows: list[int], slots: list[int]) -> WorkerBatch:
        """This decode step, launched before the step out has sampled the tokens it takes
        (DecodeOverlap): each request's input is the token of its row `rows[i]` of that
        step (input id -(row + 1)), at the position that token will have, into `slots[i]`.
        Sampling sees one output token more than the request has yet (what a seed counts)."""
        return WorkerBatch(
            mode=ForwardMode.DECODE,
            input_ids=[-(row + 1) for row in rows],
            positions=[req.seq_len for req in self.reqs],
            out_cache_loc=list(slots),
            req_pool_indices=[req.req_pool_idx for req in self.reqs],
            prefix_lens=[req.seq_len for req in self.reqs],
            extend_lens=[1] * len(self.reqs),
            sampling=[
                dataclasses.replace(self._sampling(req, {}), output_ids=[*req.output_ids, -1])
                for req in self.reqs
            ],
        )

    def _vocab_mask(self) -> torch.Tensor | None:
        """The tokens each request's grammar allows next (all for a request without one), or
        None when no request has a grammar."""
        constrained = [
            (i, req.grammar)
            for i, req in enumerate(self.reqs)
            if req.grammar is not None and not req.grammar.terminated
        ]
        if not constrained:
            return None
        mask = allocate_bitmask(len(self.reqs), constrained[0][1].vocab_size)
        for i, grammar in constrained:
            grammar.fill(mask, i)
        return mask

    def _draft_next_ids(self) -> list[int]:
        out = []
        for req in self.reqs:
            end = self.new_token_range(req)[1]
            out.append(req.token_slice(end, end + 1)[0] if end < req.num_ids else -1)
        return out

    def _verify_batch(self, banned_for: dict[str, list[int]]) -> WorkerBatch:
        """One speculative round: each request's root (its last token) at position seq_len
        and one slot per tree node in `req.spec.slots`; n-gram trees travel along (None for a
        request whose tree the worker's draft head expands)."""
        table_writes = []
        for req in self.reqs:
            stale = req.table_stale_from
            if stale is not None and stale < req.seq_len:
                table_writes.append((req.req_pool_idx, stale, req.kv_slots[stale:]))
            req.table_stale_from = None
        given = any(req.spec.draft_tokens is not None for req in self.reqs)
        return WorkerBatch(
            mode=self.mode,
            input_ids=[req.output_ids[-1] for req in self.reqs],
            positions=[req.seq_len for req in self.reqs],
            out_cache_loc=[s for req in self.reqs for s in req.spec.slots],
            req_pool_indices=[req.req_pool_idx for req in self.reqs],
            prefix_lens=[req.seq_len for req in self.reqs],
            extend_lens=[len(req.spec.slots) for req in self.reqs],
            sampling=[self._sampling(req, banned_for) for req in self.reqs],
            table_writes=table_writes,
            draft_tokens=[req.spec.draft_tokens for req in self.reqs] if given else None,
            draft_parents=[req.spec.draft_parents for req in self.reqs] if given else None,
        )

    @staticmethod
    def _sampling(req: Req, banned_for: dict[str, list[int]]) -> RequestSampling:
        p = req.sampling_params
        return RequestSampling(
            params=p,
            rid=req.rid,
            output_ids=req.output_ids,
            penalty_prompt_ids=req.input_ids if p.repetition_penalty != 1.0 else [],
            return_logprob=req.return_logprob,
            top_logprobs_num=req.top_logprobs_num,
            banned_token_ids=banned_for.get(req.rid, []),
        )
