"""GrammarIntake: requests under a grammar wait here, off the scheduler's queues, until their
grammar has compiled (on xgrammar's threads); the steps of everyone else go on meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from spectral.constrained import GrammarBackend, MadeAhead, clean_error
from spectral.core.req import FinishReason, Req
from spectral.sampling_params import InvalidRequestError

# With only grammars compiling, how long a step waits for one to finish.
COMPILE_POLL_S = 0.005


class GrammarIntake:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        # The compiler: made for the first request under a grammar, or ahead of it (`start`).
        self._backend = MadeAhead(lambda: GrammarBackend(tokenizer, vocab_size, stop_token_ids))
        self.compiling: list[Req] = []
        self.rejected: list[tuple[str, str]] = []  # (rid, why): refused after they were queued

    def start(self) -> None:
        """Make the compiler on a thread now (about a second), instead of pausing every running
        request at the first request under a grammar."""
        self._backend.start()

    def backend(self) -> GrammarBackend:
        """The compiler (and its cache of compiled grammars)."""
        return self._backend.get()

    def needs_compile(self, req: Req) -> bool:
        """Whether `req` must wait here: it has a grammar and no matcher yet. Starts the
        compile."""
        grammar = req.sampling_params.grammar
        if grammar is None or req.grammar is not None:
            return False
        self.backend().compile_later(*grammar)
        self.compiling.append(req)
        return True

    def take_compiled(self, idle: bool, admit: Callable[[Req], None]) -> None:
        """`admit` each request whose grammar has compiled; refuse those whose grammar failed
        (`take_rejected`). `idle`: nothing else to do, so wait a little for a compile to end."""
        backend = self.backend()
        compiles = [backend.compile_later(*r.sampling_params.grammar) for r in self.compiling]
        if idle:
            wait(compiles, timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        pending = []
        for req, compiled in zip(self.compiling, compiles):
            if not compiled.done():
                pending.append(req)
                continue
            try:
                self.attach(req)
            except InvalidRequestError as err:
                req.finished_reason = FinishReason("abort", message=str(err))
                self.rejected.append((req.rid, str(err)))
                continue
            admit(req)
        self.compiling = pending

    def attach(self, req: Req) -> None:
        """Give a request with a regex, json_schema or ebnf its matcher (the grammar compiled
        once per distinct text; waits for the compile); InvalidRequestError where xgrammar
        cannot compile it."""
        grammar = req.sampling_params.grammar
        if grammar is None or req.grammar is not None:
            return
        try:
            req.grammar = self.backend().matcher(*grammar, req.sampling_params.stop_token_ids)
        except RuntimeError as err:
            raise InvalidRequestError(
                f"{grammar[0]}: xgrammar cannot compile it: {clean_error(err)}", grammar[0]
            ) from None

    def take_rejected(self) -> list[tuple[str, str]]:
        """(rid, why) of the requests refused since the last call."""
        out, self.rejected = self.rejected, []
        return out

    def remove(self, rid: str) -> Req | None:
        """Take request `rid` out of the queue (an abort); None where it is not here."""
        for req in self.compiling:
            if req.rid == rid:
                self.compiling.remove(req)
                return req
        return None
