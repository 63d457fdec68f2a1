"""FinishChecker: whether a request's newest token ends it (stop tokens and strings, a stop
regex, its length, its grammar's end), and the tokens it may not sample yet."""

from __future__ import annotations

from typing import Any

from spectral.core.req import FinishReason, Req


class FinishChecker:
    def __init__(
        self, tokenizer: Any, eos_token_ids: tuple[int, ...], max_context_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_context_len = max_context_len

    def max_output(self, req: Req) -> int:
        """The most tokens `req` may generate: max_new_tokens, within the context."""
        return min(req.sampling_params.max_new_tokens, self.max_context_len - len(req.input_ids))

    def stop_ids(self, req: Req) -> list[int]:
        """The tokens that would end `req` (banned while it is below min_new_tokens)."""
        ids = list(req.sampling_params.stop_token_ids)
        if not req.sampling_params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids

    def banned(self, reqs: list[Req]) -> dict[str, list[int]]:
        """Per request still below its min_new_tokens, the tokens it may not sample."""
        return {
            req.rid: self.stop_ids(req)
            for req in reqs
            if len(req.output_ids) < req.sampling_params.min_new_tokens
        }

    def check(self, req: Req) -> FinishReason | None:
        """Why `req` ends with its newest token, or None. A matched stop string or regex sets
        where its text is cut (`req.stop_text_cut`)."""
        p = req.sampling_params
        token = req.output_ids[-1]
        if len(req.output_ids) >= p.min_new_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                return FinishReason("stop", matched=token)
            if p.stop:
                reason = self._match_stop_string(req)
                if reason is not None:
                    return reason
            if p.stop_regex:
                found = p.search_stop_regex(p.decode(self.tokenizer, req.output_ids))
                if found is not None:
                    req.stop_text_cut = found.start() if not p.no_stop_trim else None
                    return FinishReason("stop", matched=found.re.pattern)
        if len(req.output_ids) >= self.max_output(req):
            return FinishReason("length", length=len(req.output_ids))
        if req.grammar is not None and req.grammar.terminated:
            return FinishReason("stop", matched=token)  # the grammar's end (ignore_eos or not)
        return None

    def _match_stop_string(self, req: Req) -> FinishReason | None:
        p = req.sampling_params
        longest = max(len(s) for s in p.stop)
        tail = p.decode(self.tokenizer, req.output_ids[-(longest + 2) :])
        for stop in p.stop:
            if stop in tail:
                text = p.decode(self.tokenizer, req.output_ids)
                req.stop_text_cut = text.find(stop) if not p.no_stop_trim else None
                return FinishReason("stop", matched=stop)
        return None
