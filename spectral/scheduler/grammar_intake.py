"""GrammarIntake: requests under a grammar wait here, off the scheduler's queues, until their
grammar has compiled (on threads of the lowest priority); the steps of everyone else go on
meanwhile. One that waits longer than the compile timeout is refused."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from spectral.constrained import CACHE_BYTES, GrammarBackend, MadeAhead, cache_info, clean_error
from spectral.core.req import FinishReason, Req
from spectral.sampling_params import InvalidRequestError

# With only grammars compiling, how long a step waits for one to finish.
COMPILE_POLL_S = 0.005
# How long a request waits for its grammar by default (--grammar-compile-timeout; SGLang's
# grammar timeout is the same).
COMPILE_TIMEOUT_S = 300.0


class GrammarIntake:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        timeout_s: float = COMPILE_TIMEOUT_S,
        worker_ready: Callable[[str, str], bool] | None = None,
        cache_bytes: int | None = None,
    ) -> None:
        """`worker_ready(kind, text)`: whether the worker has compiled the grammar too (a
        speculative worker masks draft trees with matchers of its own), starting its compile;
        a request joins once both have, so that no step waits for one."""
        # The compiler: made for the first request under a grammar, or ahead of it (`start`).
        self.cache_bytes = CACHE_BYTES if cache_bytes is None else cache_bytes
        self._backend = MadeAhead(
            lambda: GrammarBackend(tokenizer, vocab_size, stop_token_ids, self.cache_bytes)
        )
        self.timeout_s = timeout_s
        self.worker_ready = worker_ready or (lambda kind, text: True)
        self.compiling: list[Req] = []
        self.rejected: list[tuple[str, str]] = []  # (rid, why): refused after they were queued

    def start(self) -> None:
        """Make the compiler on a thread now (about a second), instead of pausing every running
        request at the first request under a grammar."""
        self._backend.start()

    def cache_info(self) -> dict[str, int]:
        """The compiled grammars kept and their bounds (none before the compiler is made)."""
        backend = self._backend.peek()
        return backend.cache_info() if backend is not None else cache_info((), self.cache_bytes)

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
        self.worker_ready(*grammar)  # the worker's compile runs beside this one
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
        now = time.perf_counter()  # the clock of Req.created_at
        for req, compiled in zip(self.compiling, compiles):
            grammar = req.sampling_params.grammar
            done = compiled.done() and (
                compiled.exception() is not None or self.worker_ready(*grammar)
            )
            if not done:
                if now - req.created_at <= self.timeout_s:
                    pending.append(req)
                    continue
                # The compile goes on (a thread cannot be stopped) and is kept when it ends.
                self._refuse(
                    req,
                    f"{grammar[0]}: compiling it took longer than "
                    f"--grammar-compile-timeout ({self.timeout_s:g} s)",
                )
                continue
            try:
                self.attach(req, compiled)
            except InvalidRequestError as err:
                self._refuse(req, str(err))
                continue
            admit(req)
        self.compiling = pending

    def _refuse(self, req: Req, why: str) -> None:
        req.finished_reason = FinishReason("abort", message=why)
        self.rejected.append((req.rid, why))

    def attach(self, req: Req, compiled: Future | None = None) -> None:
        """Give a request with a regex, json_schema or ebnf its matcher (the grammar compiled
        once per distinct text; waits for the compile unless `compiled`, its finished compile,
        is given); InvalidRequestError where xgrammar cannot compile it."""
        grammar = req.sampling_params.grammar
        if grammar is None or req.grammar is not None:
            return
        stop_ids = req.sampling_params.stop_token_ids
        try:
            result = compiled.result() if compiled is not None else None
            req.grammar = self.backend().matcher(*grammar, stop_ids, result)
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
