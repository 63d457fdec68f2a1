"""ProgramStateGroup: the branches that `s.fork(n)` returns, and how `join` merges them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

S = TypeVar("S", bound="ForkableState")


class ForkableState(Protocol):
    """What a fork reads and writes of a program state. `ProgramState` provides it; naming it
    here keeps the dependency one way (state imports fork, not the reverse)."""

    _text: str
    _variables: dict[str, Any]
    _meta_info: dict[str, dict[str, Any]]
    _assigned: list[str]  # variable names set by this state, in order

    def sync(self) -> None: ...

    def _set_var(self, name: str | None, value: Any, meta: dict[str, Any]) -> None: ...

    def __iadd__(self: S, other: str) -> S: ...


class ProgramStateGroup(Generic[S]):
    """The branches of `s.fork(n)`: index them (`forks[i] += ...`), iterate them, `join()`."""

    def __init__(self, states: list[S], parent: S) -> None:
        self.states = states
        self.parent = parent
        self._fork_text_len = len(parent._text)

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[S]:
        return iter(self.states)

    def __getitem__(self, index: int) -> S:
        return self.states[index]

    def __setitem__(self, index: int, value: S) -> None:
        # `forks[i] += x` ends with `forks[i] = forks[i]`; nothing else may be assigned.
        if value is not self.states[index]:
            raise TypeError("the branches of a fork cannot be replaced; use forks[i] += ...")

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch, then merge into the parent state.

        "gather_variable" (the default): each variable set in any branch becomes a list on
        the parent, one value per branch (where a branch did not set it: its value at the fork,
        or None).
        "concate_and_append": the text each branch added is appended to the parent, in
        branch order."""
        for state in self.states:
            state.sync()
        if mode == "gather_variable":
            names = dict.fromkeys(name for state in self.states for name in state._assigned)
            for name in names:
                values = [state._variables.get(name) for state in self.states]
                metas = [state._meta_info.get(name) for state in self.states]
                self.parent._set_var(name, values, {"branches": metas})
        elif mode == "concate_and_append":
            self.parent += "".join(state._text[self._fork_text_len :] for state in self.states)
        else:
            raise ValueError(
                f"unknown join mode {mode!r}; use 'gather_variable' or 'concate_and_append'"
            )
