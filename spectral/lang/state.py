"""ProgramState: the `s` of a program.

`s += expr` only queues `expr`; the state's worker thread runs the queue in order, so fork
branches generate concurrently. Reads (`s["name"]`, `s.text()`, `s.fork`, ...) wait for the
queue and re-raise the worker's first error (the rest of the queue is then dropped). A
`stream=True` program fills its state in a background thread; other threads' reads wait for
the whole program, except `text_iter`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from spectral.lang.backends.base import Backend, Context
from spectral.lang.fork import ProgramStateGroup
from spectral.lang.ir import (
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    SamplingParams,
    Select,
    Text,
    as_expr,
    flatten,
)


class ProgramState:
    def __init__(self, backend: Backend, defaults: SamplingParams, stream: bool = False) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self._text = ""
        self._messages: list[dict[str, str]] = []
        self._variables: dict[str, Any] = {}
        self._meta_info: dict[str, dict[str, Any]] = {}
        self._assigned: list[str] = []  # variable names set by this state, in order
        self._partial: dict[str, str] = {}  # values of variables still being streamed
        self._role: str | None = None
        self._role_start = 0
        self._cond = threading.Condition()
        self._queue: deque[Expr] = deque()
        self._busy = False
        self._error: BaseException | None = None
        self._program_thread: threading.Thread | None = None
        self._finished = True

    # ---- writing ---------------------------------------------------------------------------

    def __iadd__(self, other: Expr | str) -> ProgramState:
        expr = as_expr(other)
        with self._cond:
            self._queue.append(expr)
            if not self._busy:
                self._busy = True
                threading.Thread(target=self._drain, daemon=True).start()
        return self

    @contextmanager
    def system(self) -> Iterator[None]:
        """`with s.system(): s += ...` is `s += system_begin(); ...; s += system_end()`."""
        with self._role_scope("system"):
            yield

    @contextmanager
    def user(self) -> Iterator[None]:
        with self._role_scope("user"):
            yield

    @contextmanager
    def assistant(self) -> Iterator[None]:
        with self._role_scope("assistant"):
            yield

    # ---- reading ---------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        self.sync()
        self._require(name)
        return self._variables[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """What the backend reported for variable `name` (for RuntimeEndpoint's gen: the
        server's meta_info, e.g. prompt_tokens, cached_tokens, finish_reason)."""
        self.sync()
        self._require(name)
        return self._meta_info.get(name, {})

    def text(self) -> str:
        """The whole prompt so far, roles rendered with the backend's chat template."""
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The finished role turns, OpenAI style: [{"role": ..., "content": ...}, ...]."""
        self.sync()
        return [dict(m) for m in self._messages]

    def sync(self) -> None:
        """Wait until everything queued has run (and, from outside a streaming program, until
        the program is over); raise the first error it hit."""
        with self._cond:
            if self._program_thread not in (None, threading.current_thread()):
                self._cond.wait_for(lambda: self._finished)
            self._cond.wait_for(lambda: not self._busy)
            if self._error is not None:
                raise self._error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the text (or variable `var_name`) piece by piece as it is produced. Without
        `stream=True` there is one piece, once the program is over."""
        if not self.stream:
            yield self.text() if var_name is None else str(self[var_name])
            return
        sent = 0
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda sent=sent: (
                        self._stream_over(var_name) or len(self._value(var_name)) > sent
                    )
                )
                value, over = self._value(var_name), self._stream_over(var_name)
            if len(value) > sent:
                yield value[sent:]
                sent = len(value)
            elif over:
                break
        with self._cond:
            if self._error is not None:
                raise self._error
        if var_name is not None:
            self._require(var_name)

    def _require(self, name: str) -> None:
        if name not in self._variables:
            known = ", ".join(repr(n) for n in self._variables) or "none yet"
            raise KeyError(
                f"no variable {name!r} in this program state; known variables: {known} "
                "(gen(name) and select(name) create them)"
            )

    # ---- forks -----------------------------------------------------------------------------

    def fork(self, size: int = 1) -> ProgramStateGroup[ProgramState]:
        """`size` copies of this state (text, messages, variables) that run independently.
        The shared text is sent to the backend first (`cache_prefix`), so that the branches
        reuse its KV cache."""
        if size < 1:
            raise ValueError(f"fork() needs at least one branch (got {size})")
        self.sync()
        self.backend.cache_prefix(self._text)
        return ProgramStateGroup([self._copy() for _ in range(size)], self)

    def _copy(self) -> ProgramState:
        child = ProgramState(self.backend, self.defaults)
        child._text = self._text
        child._messages = [dict(m) for m in self._messages]
        child._variables = dict(self._variables)
        child._meta_info = dict(self._meta_info)
        child._role, child._role_start = self._role, self._role_start
        return child

    # ---- streaming programs (used by Function.run) -----------------------------------------

    def start_program(self, body: Callable[[], None]) -> None:
        """Run `body` (the program, writing into this state) in a background thread."""

        def target() -> None:
            try:
                body()
                self.sync()
            except BaseException as err:
                with self._cond:
                    self._error = self._error or err
            finally:
                with self._cond:
                    self._finished = True
                    self._cond.notify_all()

        thread = threading.Thread(target=target, daemon=True)
        self._program_thread, self._finished = thread, False
        thread.start()

    # ---- the worker ------------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            with self._cond:
                if self._error is not None:
                    self._queue.clear()
                if not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    return
                expr = self._queue.popleft()
            try:
                for leaf in flatten(expr):
                    self._execute(leaf)
            except BaseException as err:
                with self._cond:
                    self._error = err

    def _execute(self, leaf: Expr) -> None:
        if isinstance(leaf, Text):
            self._append(leaf.value)
        elif isinstance(leaf, RoleBegin):
            self._begin_role(leaf.role)
        elif isinstance(leaf, RoleEnd):
            self._end_role(leaf.role)
        elif isinstance(leaf, Gen):
            self._gen(leaf)
        elif isinstance(leaf, Select):
            choice = self.backend.select(self._context(), list(leaf.choices), leaf.temperature)
            self._append(choice.decision)
            self._set_var(leaf.name, choice.decision, choice.meta_info)
        else:
            raise TypeError(f"cannot execute {leaf!r}")

    def _gen(self, node: Gen) -> None:
        params = node.params.merged_with(self.defaults)
        if not self.stream:
            result = self.backend.generate(self._context(), params)
            self._append(result.text)
            self._set_var(node.name, result.text, result.meta_info)
            return
        value, meta = "", {}
        for delta, latest in self.backend.generate_stream(self._context(), params):
            value, meta = value + delta, latest
            self._append(delta, node.name)
        self._set_var(node.name, value, meta)

    def _begin_role(self, role: str) -> None:
        if self._role is not None:
            raise ValueError(
                f"{role}_begin() while the {self._role} role is open; "
                f"close it with {self._role}_end() first"
            )
        template = self.backend.chat_template
        if role != "system" and not self._messages and template.default_system_prompt:
            self._begin_role("system")
            self._append(template.default_system_prompt)
            self._end_role("system")
        self._append(template.begin(role))
        self._role, self._role_start = role, len(self._text)

    def _end_role(self, role: str) -> None:
        if self._role != role:
            open_now = f"the {self._role} role is open" if self._role else "no role is open"
            raise ValueError(f"{role}_end() without a matching {role}_begin() ({open_now})")
        content = self._text[self._role_start :]
        self._append(self.backend.chat_template.end(role))
        self._messages.append({"role": role, "content": content})
        self._role = None

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def _context(self) -> Context:
        role_text = self._text[self._role_start :] if self._role else ""
        return Context(self._text, [dict(m) for m in self._messages], self._role, role_text)

    def _append(self, text: str, var_name: str | None = None) -> None:
        with self._cond:
            self._text += text
            if var_name is not None:
                self._partial[var_name] = self._partial.get(var_name, "") + text
            self._cond.notify_all()

    def _set_var(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is None:
            return
        with self._cond:
            self._variables[name] = value
            self._meta_info[name] = meta
            self._assigned.append(name)
            self._partial.pop(name, None)
            self._cond.notify_all()

    def _value(self, var_name: str | None) -> str:
        if var_name is None:
            return self._text
        if var_name in self._variables:
            return str(self._variables[var_name])
        return self._partial.get(var_name, "")

    def _stream_over(self, var_name: str | None) -> bool:
        if self._finished or self._error is not None:
            return True
        return var_name is not None and var_name in self._variables
