"""Running programs: `Function.run`, `Function.run_batch`, and the default backend."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

from spectral.lang.backends.base import Backend, Choice, Context, Generation
from spectral.lang.ir import SamplingParams
from spectral.lang.state import ProgramState

# A shared prefix shorter than this is not worth a request of its own before a batch.
MIN_SHARED_PREFIX_CHARS = 64
# Threads of run_batch(num_threads="auto"), at most one per program.
AUTO_THREADS = 64

_default_backend: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    """The backend `run`/`run_batch` use when they are given none."""
    global _default_backend
    _default_backend = backend


def _backend_or_default(backend: Backend | None) -> Backend:
    backend = backend or _default_backend
    if backend is None:
        raise RuntimeError(
            "no backend: call spectral.set_default_backend(spectral.RuntimeEndpoint(url)) "
            "first, or pass backend= to run()/run_batch()"
        )
    return backend


class Function:
    """A program: a Python function whose first parameter is the state `s`.

    Calling it with a state first (`other_program(s, ...)`, inside a program) runs its body
    on that state, so programs compose; calling it otherwise is `run(...)`, as in SGLang."""

    def __init__(self, func: Callable[..., Any]) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(
                f"@function program {func.__name__}() must take the state as its first "
                "parameter, as in def program(s, question): ..."
            )
        self.func = func
        self._signature = inspect.signature(func)
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **kwargs)
        return self.run(*args, **kwargs)

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stream: bool = False,
        backend: Backend | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program on a new state and return it. The sampling keywords are the
        defaults of every `gen` that does not set its own. With `stream=True` it returns at
        once and the program runs in the background (read it with `text_iter()`)."""
        self._check_arguments(args, kwargs)
        defaults = _defaults(max_new_tokens, stop, temperature, top_p, top_k)
        state = ProgramState(_backend_or_default(backend), defaults, stream)
        if stream:
            state.start_program(lambda: self.func(state, *args, **kwargs))
        else:
            self.func(state, *args, **kwargs)
            state.sync()
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
    ) -> list[ProgramState]:
        """Run the program once per keyword dict, `num_threads` at a time ("auto": one
        thread per program, at most 64), and return the states in order. Raises the first
        (in batch order) program's error, after every program has ended.

        Before the batch, the text every program starts with (found by running each program
        up to its first gen/select, so code before that runs twice) is sent once with
        `backend.cache_prefix`, so that the batch reuses its KV cache."""
        backend = _backend_or_default(backend)
        for kwargs in batch_kwargs:
            self._check_arguments((), kwargs)
        if not batch_kwargs:
            return []
        if num_threads == "auto":
            num_threads = min(len(batch_kwargs), AUTO_THREADS)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or an integer >= 1 (got {num_threads!r})")
        prefix = os.path.commonprefix([self._traced_prefix(backend, kw) for kw in batch_kwargs])
        if len(prefix) >= MIN_SHARED_PREFIX_CHARS:
            backend.cache_prefix(prefix)
        sampling = dict(
            max_new_tokens=max_new_tokens,
            stop=stop,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
        )
        with ThreadPoolExecutor(num_threads) as pool:
            futures = [
                pool.submit(self.run, backend=backend, **sampling, **kwargs)
                for kwargs in batch_kwargs
            ]
            done: Iterable[Future] = as_completed(futures)
            for _ in _with_progress(done, len(futures)) if progress_bar else done:
                pass
        return [future.result() for future in futures]

    def _check_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._signature.bind(None, *args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self.func.__name__}(): {err}") from None

    def _traced_prefix(self, backend: Backend, kwargs: dict[str, Any]) -> str:
        """The text the program writes before it first needs the backend."""
        state = ProgramState(_PrefixTracer(backend), SamplingParams())
        try:
            self.func(state, **kwargs)
            state.sync()
        except Exception:
            pass
        return state._text


class _EndOfPrefix(Exception):
    pass


class _PrefixTracer(Backend):
    """Renders roles like `backend` and stops the program at its first gen/select/fork."""

    def __init__(self, backend: Backend) -> None:
        self.chat_template = backend.chat_template

    def generate(self, ctx: Context, params: SamplingParams) -> Generation:
        raise _EndOfPrefix

    def generate_stream(
        self, ctx: Context, params: SamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        raise _EndOfPrefix

    def select(self, ctx: Context, choices: list[str], temperature: float) -> Choice:
        raise _EndOfPrefix

    def cache_prefix(self, text: str) -> None:
        raise _EndOfPrefix


def _defaults(
    max_new_tokens: int,
    stop: str | Sequence[str] | None,
    temperature: float,
    top_p: float,
    top_k: int,
) -> SamplingParams:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(max_new_tokens, stops or None, temperature, top_p, top_k)


def _with_progress(items: Iterable[Future], total: int) -> Iterator[Future]:
    """`items`, with tqdm's bar when tqdm is installed, else a counter on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        for count, item in enumerate(items, 1):
            print(f"\r{count}/{total} programs done", end="", file=sys.stderr, flush=True)
            yield item
        print(file=sys.stderr)
        return
    yield from tqdm(items, total=total)
