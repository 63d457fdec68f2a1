"""Per-request sampling parameters, with SGLang's names, validated once on arrival."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

GREEDY_EPS = 1e-6


class InvalidRequestError(ValueError):
    """A request the caller got wrong; the message says what and what is allowed."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        params = dict(params or {})
        if "sampling_seed" in params:
            params.setdefault("seed", params.pop("sampling_seed"))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        params = {k: v for k, v in params.items() if v is not None}
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self, vocab_size: int | None = None) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(msg)

        for name in ("max_new_tokens", "min_new_tokens", "top_k"):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool),
                f"{name} must be an integer (got {value!r})",
            )
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool),
                f"{name} must be a number (got {value!r})",
            )
        need(self.max_new_tokens >= 0, f"max_new_tokens must be >= 0 (got {self.max_new_tokens})")
        need(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            f"min_new_tokens must be between 0 and max_new_tokens={self.max_new_tokens} "
            f"(got {self.min_new_tokens})",
        )
        need(self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature})")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})")
        need(
            self.top_k == -1 or self.top_k >= 1,
            f"top_k must be -1 (off) or >= 1 (got {self.top_k})",
        )
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p})")
        need(
            -2 <= self.frequency_penalty <= 2,
            f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty})",
        )
        need(
            -2 <= self.presence_penalty <= 2,
            f"presence_penalty must be in [-2, 2] (got {self.presence_penalty})",
        )
        need(
            self.repetition_penalty > 0,
            f"repetition_penalty must be > 0 (got {self.repetition_penalty})",
        )
        need(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a non-empty string or a list of them (got {self.stop!r})",
        )
        need(
            isinstance(self.stop_token_ids, list)
            and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be a list of token ids (got {self.stop_token_ids!r})",
        )
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            need(not bad, f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
        need(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            f"seed must be an integer (got {self.seed!r})",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
