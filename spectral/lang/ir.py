"""The program IR: what `s += ...` appends to a state.

Expressions are small immutable nodes. `+` between expressions (or an expression and a str)
builds an `ExprList`, so `"Answer: " + gen("answer")` is one expression that runs in order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one `gen`. A field left at None takes the program's default (the
    keyword arguments of `run`/`run_batch`), see `merged_with`."""

    max_new_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    regex: str | None = None

    def merged_with(self, defaults: SamplingParams) -> SamplingParams:
        """These settings, with every unset field taken from `defaults`."""
        unset = {
            f.name: getattr(defaults, f.name) for f in fields(self) if getattr(self, f.name) is None
        }
        return replace(self, **unset)

    def to_native(self) -> dict[str, Any]:
        """`sampling_params` for the native `POST /generate` (SGLang's names)."""
        out: dict[str, Any] = {}
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        if self.stop:
            out["stop"] = list(self.stop)
        for name in ("temperature", "top_p", "top_k", "regex"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def to_openai(self) -> dict[str, Any]:
        """Keyword arguments for the openai client; `top_k` and `regex` (not OpenAI parameters;
        SGLang's and spectral's servers take them) go in `extra_body`, and only when set."""
        out: dict[str, Any] = {}
        if self.max_new_tokens is not None:
            out["max_tokens"] = self.max_new_tokens
        if self.stop:
            out["stop"] = list(self.stop)
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        extra: dict[str, Any] = {}
        if self.top_k is not None and self.top_k != -1:
            extra["top_k"] = self.top_k
        if self.regex is not None:
            extra["regex"] = self.regex  # SGLang's extension; other servers refuse it
        if extra:
            out["extra_body"] = extra
        return out


class Expr:
    """Anything that can be appended to a program state."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList((self, *_as_list(other)))

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList((*_as_list(other), self))


@dataclass(frozen=True)
class Text(Expr):
    value: str


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text and store it under `name` (not stored when `name` is None)."""

    name: str | None
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Select(Expr):
    """Append the most likely of `choices` and store it under `name`."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float = 0.0


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class ExprList(Expr):
    items: tuple[Expr, ...]


def as_expr(value: Expr | str) -> Expr:
    """A str becomes `Text`; anything else must already be an expression."""
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, Expr):
        return value
    raise TypeError(
        "a program state takes text or DSL expressions (gen, select, system/user/assistant), "
        f"not {type(value).__name__}: {value!r}"
    )


def flatten(expr: Expr) -> list[Expr]:
    """The leaves of `expr`, in execution order."""
    if isinstance(expr, ExprList):
        return [leaf for item in expr.items for leaf in flatten(item)]
    return [expr]


def check_regex(regex: str | None) -> None:
    """Raise ValueError for a pattern Python cannot compile (before any request is sent)."""
    if regex is None:
        return
    try:
        re.compile(regex)
    except re.error as err:
        raise ValueError(f"gen(regex={regex!r}) is not a valid regular expression: {err}") from err


def _as_list(value: Expr | str) -> tuple[Expr, ...]:
    expr = as_expr(value)
    return expr.items if isinstance(expr, ExprList) else (expr,)
