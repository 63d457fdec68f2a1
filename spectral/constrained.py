"""Structured outputs: `regex`, `json_schema` and `ebnf` constraints through xgrammar.

A request's grammar is compiled once per distinct (kind, text) by the scheduler's
`GrammarBackend` (a cache) and followed by a `GrammarMatcher` whose state is exactly the
request's committed output. Every step the matcher fills the request's row of a token bitmask
(one bit per vocabulary entry, 32 to an int32); the worker applies it to the logits after the
penalties and before temperature and the filters, so the sampled token always continues the
grammar. Stop tokens are allowed only where the grammar may end; the grammar ending finishes
the request.

`grammar_error` checks a grammar's text without a tokenizer (milliseconds), so that the HTTP
layer refuses a bad one with xgrammar's reason before anything is queued.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")
MAX_JSON_WHITESPACE = 16
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; clients get the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgrammar() -> Any:
    import xgrammar

    return xgrammar


def clean_error(err: Exception) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(err).strip().splitlines()[0] if str(err) else repr(err))


def grammar_error(kind: str, text: str) -> str | None:
    """Why xgrammar cannot use `text` as a `kind` grammar (None: it can)."""
    xgr = _xgrammar()
    parse = {
        "regex": xgr.Grammar.from_regex,
        "json_schema": xgr.Grammar.from_json_schema,
        "ebnf": xgr.Grammar.from_ebnf,
    }[kind]
    try:
        parse(text)
    except Exception as err:  # xgrammar raises RuntimeError with its parser's message
        return clean_error(err)
    return None


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarBackend:
    """Compiles grammars for one model's vocabulary (cached by kind and text) and makes the
    matchers that follow them."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._compiled: dict[tuple[str, str], Any] = {}

    def compile(self, kind: str, text: str) -> Any:
        key = (kind, text)
        if key not in self._compiled:
            if kind == "json_schema":
                # Any whitespace between elements, as SGLang allows, but at most
                # MAX_JSON_WHITESPACE characters in a row: sampled small models otherwise fill
                # their budget with newlines inside an object.
                compiled = self.compiler.compile_json_schema(
                    text, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
                )
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            else:
                compiled = self.compiler.compile_grammar(text)
            self._compiled[key] = compiled
        return self._compiled[key]

    def matcher(self, kind: str, text: str, extra_stop_ids: Sequence[int] = ()) -> Grammar:
        """A matcher at the grammar's start; the request's own stop token ids end it too."""
        xgr = _xgrammar()
        stops = sorted(set(self.stop_token_ids) | set(extra_stop_ids))
        matcher = xgr.GrammarMatcher(self.compile(kind, text), override_stop_tokens=stops)
        return Grammar(matcher, self.vocab_size)


class Grammar:
    """One request's place in its grammar: the committed output so far."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: the tokens that may come next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32, every token allowed."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with the tokens each row's bitmask forbids set to -inf (a new tensor)."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))
