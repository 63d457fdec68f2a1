"""The interface every backend implements, and what a backend sees of a program state."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from spectral.lang.chat_template import CHATML, ChatTemplate
from spectral.lang.ir import SamplingParams


@dataclass(frozen=True)
class Context:
    """A snapshot of a program state at a `gen` or `select`.

    `text` is the whole prompt so far (roles rendered with the chat template); `messages` are
    the finished role turns; `role` is the role now open (None outside roles) and `role_text`
    what has been written inside it so far."""

    text: str
    messages: list[dict[str, str]] = field(default_factory=list)
    role: str | None = None
    role_text: str = ""


@dataclass
class Generation:
    """The result of `generate`: the text and the backend's meta information."""

    text: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Choice:
    """The result of `select`: the chosen choice and how it was chosen (scores, if any)."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class BackendError(RuntimeError):
    """The backend answered with an error; the message says where and what."""


class Backend(ABC):
    """Backends are shared by every thread of `run_batch` and by forks: every method may be
    called concurrently and keeps no per-program state."""

    chat_template: ChatTemplate = CHATML

    @abstractmethod
    def generate(self, ctx: Context, params: SamplingParams) -> Generation:
        """Generate a continuation of `ctx` (stop strings excluded from the text)."""

    @abstractmethod
    def generate_stream(
        self, ctx: Context, params: SamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Like `generate`, yielding (new text, meta_info so far) as the text grows; the
        concatenated pieces equal what `generate` would return."""

    @abstractmethod
    def select(self, ctx: Context, choices: list[str], temperature: float) -> Choice:
        """Choose the most likely continuation of `ctx` among `choices` (non-empty)."""

    def cache_prefix(self, text: str) -> None:
        """Hint that several requests starting with `text` follow (forks, run_batch). The
        default does nothing."""
        return None
