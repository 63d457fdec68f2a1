"""Structured outputs: `regex`, `json_schema` and `ebnf` constraints through xgrammar.

A grammar is compiled once per distinct text (`GrammarBackend`); a request's `Grammar` matcher
is exactly its committed output and fills its row of the token bitmask each step; under
speculation `GrammarFollower` keeps the worker's own matchers to mask draft trees node by node.
More in docs/internals.md ("Structured outputs")."""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Any, Generic, TypeVar

import numpy as np
import torch

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


# Compiles at once: a long one (a schema with a 20,000-value enum takes seconds) leaves the
# other slot to the next grammar.
COMPILE_THREADS = 2
# xgrammar's own threads within one compile (they inherit their caller's priority).
COMPILE_THREADS_EACH = 2
# Compiled grammars kept (by kind and text, least recently used first out): at most this many,
# and at most this many bytes of them (xgrammar's measure; a 20,000-value enum is ~46 MB).
CACHE_ENTRIES = 256
CACHE_BYTES = 512 * 2**20  # the default of --grammar-cache-mib
# The compiling threads' nice value: against the model's threads at 0 they get about a tenth of
# a contended core (19 would starve them for as long as the model runs).
COMPILE_NICENESS = 10


def lower_thread_priority(niceness: int = COMPILE_NICENESS) -> None:
    """Lower the calling thread's priority to `niceness` (Linux: a thread's own nice value,
    which the threads it starts inherit); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        except OSError:  # a sandbox that refuses it: the compile runs, at normal priority
            pass


def release_freed_memory() -> None:
    """Give the pages malloc holds free back to the system (glibc's malloc_trim: a compile's
    working memory and an evicted grammar would otherwise stay in the process's RSS as its
    high-water mark); elsewhere nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class GrammarBackend:
    """Compiles grammars for one model's vocabulary and makes the matchers that follow them.
    Compiles run on COMPILE_THREADS threads of the lowest priority; compiled grammars (and
    failures) are kept by kind and text within CACHE_ENTRIES and `cache_bytes`."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_bytes: int | None = None,
    ) -> None:
        xgr = _xgrammar()
        self.cache_bytes = CACHE_BYTES if cache_bytes is None else cache_bytes
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        # xgrammar's cache is unbounded: this one keeps what is compiled, within its bounds.
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=COMPILE_THREADS_EACH, cache_enabled=False
        )
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def compile_later(self, kind: str, text: str) -> Future:
        """The compiled grammar, compiled on a thread of its own (xgrammar releases the GIL, so
        the scheduler keeps stepping meanwhile). Failures are kept too: the same bad text fails
        at once the next time."""
        key = (kind, text)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                COMPILE_THREADS,
                thread_name_prefix="grammar-compile",
                initializer=lower_thread_priority,
            )
        self._compiled[key] = future = self._pool.submit(self._compile, kind, text)
        self._evict()
        return future

    def cache_info(self) -> dict[str, int]:
        return cache_info(self._compiled.values(), self.cache_bytes)

    def holds(self, key: tuple[str, str]) -> bool:
        """Whether the cache keeps the compile of grammar `key` (kind, text)."""
        return key in self._compiled

    def _evict(self) -> None:
        """Forget the least recently asked-for compiled grammars beyond the bounds. Compiles
        still running stay (their size is not known yet: the next call counts them), and so
        does the most recent one (a request is about to use it)."""
        total = sum(map(compiled_bytes, self._compiled.values()))
        evicted = False
        for key, future in list(self._compiled.items())[:-1]:
            if len(self._compiled) <= CACHE_ENTRIES and total <= self.cache_bytes:
                break
            if future.done():
                total -= compiled_bytes(future)
                del self._compiled[key]
                evicted = True
        if evicted:
            release_freed_memory()

    def compile(self, kind: str, text: str) -> Any:
        return self.compile_later(kind, text).result()

    def _compile(self, kind: str, text: str) -> Any:
        try:
            return self._compile_now(kind, text)
        finally:
            release_freed_memory()  # the compile's working memory

    def _compile_now(self, kind: str, text: str) -> Any:
        if kind == "json_schema":
            # Any whitespace between elements, as SGLang allows, but at most
            # MAX_JSON_WHITESPACE characters in a row: sampled small models otherwise fill
            # their budget with newlines inside an object.
            return self.compiler.compile_json_schema(
                text, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
        if kind == "regex":
            return self.compiler.compile_regex(text)
        return self.compiler.compile_grammar(text)

    def matcher(
        self, kind: str, text: str, extra_stop_ids: Sequence[int] = (), compiled: Any = None
    ) -> Grammar:
        """A matcher at the grammar's start; the request's own stop token ids end it too.
        `compiled`: the grammar's compile, where the caller kept it (the cache may have let
        it go since), else it is looked up (and compiled again where it was let go). Compiles
        that ended since the last call count against the cache's bounds from here."""
        xgr = _xgrammar()
        if compiled is None:
            compiled = self.compile(kind, text)
        self._evict()
        stops = sorted(set(self.stop_token_ids) | set(extra_stop_ids))
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        return Grammar(matcher, self.vocab_size)


def cache_info(compiled: Collection[Future], max_bytes: int = CACHE_BYTES) -> dict[str, int]:
    """Grammars kept, the bytes of the compiled ones, and the cache's bounds."""
    return {
        "entries": len(compiled),
        "bytes": sum(map(compiled_bytes, compiled)),
        "max_entries": CACHE_ENTRIES,
        "max_bytes": max_bytes,
    }


def compiled_bytes(future: Future) -> int:
    """What a finished compile holds (0 for one running or failed)."""
    if not future.done() or future.exception() is not None:
        return 0
    return int(future.result().memory_size_bytes)


T = TypeVar("T")


class MadeAhead(Generic[T]):
    """A value made on first use (`get`), or ahead of it on a thread of its own (`start`): for
    the grammar compiler, whose table of the vocabulary takes about a second to build (and a
    worker process must import transformers for it first), so that the first request under a
    grammar does not pause every running request while it is made."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._value: T | None = None
        self._making: Future[T] | None = None

    def start(self) -> None:
        """Make it on a thread now (call once the process is otherwise ready: it competes for
        the CPU)."""
        if self._value is None and self._making is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="made-ahead")
            self._making = pool.submit(self._make)
            pool.shutdown(wait=False)  # its thread ends with this one task

    def peek(self) -> T | None:
        """The value where it has been made, else None (without making it)."""
        return self._value

    def get(self) -> T:
        if self._value is None:
            self._value = self._making.result() if self._making else self._make()
        return self._value


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

    def tree_bitmask(
        self, tokens: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor
    ) -> torch.Tensor:
        """[nodes, words]: row j holds the tokens the grammar allows after the path from the
        root (the last committed token, node 0) to node j. A node the grammar rejects cannot
        be accepted (its parent's row forbids it), so its row, its descendants' and that of a
        node ending the grammar are never sampled from; they allow every token, so that no row
        is all -inf. The matcher's state is unchanged."""
        nodes = tokens.shape[0]
        mask = allocate_bitmask(nodes, self.vocab_size)
        self.matcher.traverse_draft_tree(
            next_token.contiguous(), next_sibling.contiguous(), tokens.contiguous(), mask
        )
        mask[(mask == 0).all(dim=1)] = -1
        return mask

    def forced_tokens(self, encode: Callable[[str], list[int]], limit: int) -> list[int]:
        """Up to `limit` tokens of the only text the grammar allows next (empty where it allows
        a choice), tokenized by `encode` and cut where the grammar stops taking them."""
        text = self.matcher.find_jump_forward_string()
        if not text or limit <= 0:
            return []
        taken: list[int] = []
        for token in encode(text)[:limit]:
            if not self.matcher.accept_token(token):
                break
            taken.append(token)
            if self.matcher.is_terminated():
                break
        if taken:
            self.matcher.rollback(len(taken))
        return taken


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32, every token allowed."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, kernels: ModuleType | None = None
) -> torch.Tensor:
    """Set the logits each row's bitmask forbids to -inf, in place; returns `logits`. With
    spectral's CPU kernels, one pass in C++ over the mask words (words of all ones skipped,
    words of zeros filled at once); elsewhere (CUDA, --disable-cpu-kernels) the rows that
    forbid anything, through torch."""
    if (
        kernels is not None
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.is_contiguous()
    ):
        kernels.apply_token_bitmask(logits, bitmask.contiguous())
        return logits
    words = bitmask.numpy()
    rows = np.flatnonzero((words != -1).any(axis=1))
    if rows.size == 0:
        return logits
    # Token t is bit t % 32 of word t // 32: on a little-endian machine, bit t of the words'
    # bytes read in order, least significant bit first.
    bits = np.unpackbits(words[rows].view(np.uint8), axis=1, bitorder="little")
    forbidden = torch.from_numpy(bits[:, : logits.shape[-1]]).to(logits.device) == 0
    index = torch.from_numpy(rows).to(logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
    return logits
