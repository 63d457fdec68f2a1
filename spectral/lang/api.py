"""The names programs use: `function`, `gen`, `select` and the roles (SGLang's spelling)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spectral.lang.interpreter import Function
from spectral.lang.ir import (
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    SamplingParams,
    Select,
    as_expr,
    check_regex,
)


def function(func: Callable[..., Any] | None = None) -> Any:
    """Decorator turning `def program(s, ...)` into a runnable `Function`; usable bare
    (`@function`) or called (`@function()`)."""
    if func is None:
        return Function
    return Function(func)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    *,
    stop: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    regex: str | None = None,
    choices: Sequence[str] | None = None,
) -> Expr:
    """Generate text into variable `name`. Unset sampling fields take the defaults given to
    `run`. With `choices` this is `select(name, choices)`. With `regex` the output fully
    matches it (the server constrains decoding; the OpenAI backend sends it as SGLang's `regex`
    extension, which servers without it refuse)."""
    if choices is not None:
        return select(name, choices, temperature=temperature or 0.0)
    check_regex(regex)
    stops = (stop,) if isinstance(stop, str) else (tuple(stop) if stop is not None else None)
    return Gen(name, SamplingParams(max_tokens, stops, temperature, top_p, top_k, regex))


def select(
    name: str | None = None, choices: Sequence[str] | None = None, temperature: float = 0.0
) -> Expr:
    """Append whichever of `choices` the model finds most likely, and store it in `name`.
    RuntimeEndpoint scores each choice by the mean logprob of its tokens."""
    if not choices:
        raise ValueError(f"select({name!r}) needs at least one choice (got {choices!r})")
    bad = [c for c in choices if not isinstance(c, str) or not c]
    if bad:
        raise ValueError(f"select({name!r}) choices must be non-empty strings (got {bad!r})")
    return Select(name, tuple(choices), temperature)


def _role(role: str, content: Expr | str | None) -> Expr:
    if content is None:
        return ExprList((RoleBegin(role), RoleEnd(role)))
    return ExprList((RoleBegin(role), as_expr(content), RoleEnd(role)))


def system(content: Expr | str | None = None) -> Expr:
    """A system turn holding `content` (text, gen, select, or a sum of them)."""
    return _role("system", content)


def user(content: Expr | str | None = None) -> Expr:
    return _role("user", content)


def assistant(content: Expr | str | None = None) -> Expr:
    return _role("assistant", content)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")
