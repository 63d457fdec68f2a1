"""Per-request sampling parameters, with SGLang's names, validated once on arrival.

`SamplingParams` is what the runtime carries (a plain dataclass; its defaults are the only
statement of them). `SamplingParamsModel` is the one statement of what each parameter may be
(types, ranges, list lengths): the HTTP layer publishes it in the OpenAPI document, and
`SamplingParams.from_dict` and `SamplingParams.validate` check against it, so the offline engine
and the server refuse the same things with the same words.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

GREEDY_EPS = 1e-6
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Hard caps on list sizes; a server sets its own, tighter ones (ServerArgs' request limits).
MAX_STOP_STRINGS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_CHARS = 4096


class InvalidRequestError(ValueError):
    """A request the caller got wrong; the message says what and what is allowed. `param` names
    the offending field where one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    def from_dict(cls, params: dict[str, Any] | None, where: str = "") -> SamplingParams:
        """Validated parameters from a client's dict (None and missing keys take defaults)."""
        params = dict(params or {})
        if "sampling_seed" in params:
            params.setdefault("seed", params.pop("sampling_seed"))
        return check_model(SamplingParamsModel, params, where).to_params()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError unless every field is allowed (and, given the vocabulary
        size, every stop token id is in it)."""
        check_model(SamplingParamsModel, dataclasses.asdict(self))
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"stop_token_ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                    "stop_token_ids",
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


def finite(**bounds: float) -> Any:
    """A finite JSON number (an int or a float; not a bool, not a string) within `bounds`."""
    return Field(strict=True, allow_inf_nan=False, **bounds)


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"text must be valid Unicode; it has a lone surrogate at character {err.start}"
        ) from None
    return value


# The document says so too, so that schema-driven clients (and fuzzers) generate valid text.
NO_SURROGATES = {"pattern": r"^[^\ud800-\udfff]*$"}


def text(**bounds: int) -> Any:
    """Text from a client within length `bounds`: a string that encodes as UTF-8 (JSON's
    \\ud800 escapes allow lone surrogates, which no tokenizer or encoder takes)."""
    return Annotated[str, Field(**bounds, json_schema_extra=NO_SURROGATES), AfterValidator(_utf8)]


Text = text()

# The types of the parameters, shared by every request model that takes them.
Count = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
Flag = Annotated[bool, Field(strict=True)]
Temperature = Annotated[float, finite(ge=0, le=1e6)]
TopP = Annotated[float, finite(gt=0, le=1)]
TopK = Annotated[int, Field(strict=True, ge=-1, le=INT32_MAX, description="-1: off")]
MinP = Annotated[float, finite(ge=0, le=1)]
Penalty = Annotated[float, finite(ge=-2, le=2)]
# Below 0.01 the divided logits overflow to infinity and sampling would see NaNs.
RepetitionPenalty = Annotated[float, finite(ge=0.01, le=100)]
StopString = text(min_length=1, max_length=MAX_STOP_CHARS)
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]

_D = SamplingParams  # the defaults


class SamplingParamsModel(BaseModel):
    """Sampling parameters as a client sends them (SGLang's names; null means the default)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Count = _D.max_new_tokens
    min_new_tokens: Count = _D.min_new_tokens
    temperature: Temperature = _D.temperature
    top_p: TopP = _D.top_p
    top_k: TopK = _D.top_k
    min_p: MinP = _D.min_p
    frequency_penalty: Penalty = _D.frequency_penalty
    presence_penalty: Penalty = _D.presence_penalty
    repetition_penalty: RepetitionPenalty = _D.repetition_penalty
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: Flag = _D.ignore_eos
    skip_special_tokens: Flag = _D.skip_special_tokens
    no_stop_trim: Flag = _D.no_stop_trim
    seed: Seed | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return value

    @field_validator("min_new_tokens")
    @classmethod
    def _min_below_max(cls, value: int, info: ValidationInfo) -> int:
        most = info.data.get("max_new_tokens", _D.max_new_tokens)
        if value > most:
            raise ValueError(f"min_new_tokens must not exceed max_new_tokens ({most})")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_params(self) -> SamplingParams:
        values = {k: getattr(self, k) for k in type(self).model_fields}
        values["stop"] = self.stop_list()
        values["stop_token_ids"] = list(self.stop_token_ids or [])
        return SamplingParams(**values)


def check_model(model: type[BaseModel], data: Any, where: str = "") -> Any:
    """`model.model_validate(data)`, with a failure turned into InvalidRequestError."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err.errors(), where, list(model.model_fields)) from None


# Where pydantic's error locations name a branch of a union ("str", "list[int]",
# "constrained-str") rather than a field or an index.
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict)$|^[A-Z]|[\[\-]")


def validation_error(
    errors: list[dict[str, Any]], where: str = "", fields: list[str] | None = None
) -> InvalidRequestError:
    """One InvalidRequestError for pydantic's errors: each names the field, says what was
    wrong (which says what is allowed) and what it got, cut short so that a huge value is not
    echoed back; an unknown field is told the allowed ones (`fields` at the top level).
    Where a value matched no branch of a union, a branch whose type fitted
    explains why; only if none fitted are the types listed."""
    by_path: dict[str, list[dict[str, Any]]] = {}
    for e in errors:
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "")
            return InvalidRequestError(f"invalid request: the body is not JSON ({reason})")
        parts = [str(p) for p in e.get("loc", ()) if p != "body"]
        parts = [p for p in parts if not (_UNION_TAG.search(p) and not p.isdigit())]
        path = ".".join([where] * bool(where) + parts) or "body"
        by_path.setdefault(path, []).append(e)
    # Where some branch of a union took the value's shape and found a value out of bounds,
    # the branches whose type did not fit say nothing.
    wrong_type = [e for e in errors if e.get("type", "").endswith("_type")]
    if len(wrong_type) < len(errors):
        by_path = {
            path: kept
            for path, errs in by_path.items()
            if (kept := [e for e in errs if e not in wrong_type])
        }
    problems = []
    for path, errs in by_path.items():
        allowed = fields if "." not in path.removeprefix(f"{where}.") else None
        if path.startswith("sampling_params."):
            allowed = list(SamplingParamsModel.model_fields)
        messages = " or ".join(dict.fromkeys(_message(e, allowed) for e in errs))
        got = ""
        if "input" in errs[0] and errs[0].get("type") not in ("missing", "extra_forbidden"):
            got = f" (got {short_repr(errs[0]['input'])})"
        problems.append((path, f"{path}: {messages}{got}"))
    shown = "; ".join(text for _, text in problems[:10])
    more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
    return InvalidRequestError("invalid request: " + shown + more, problems[0][0])


def _message(error: dict[str, Any], allowed: list[str] | None) -> str:
    if error.get("type") == "extra_forbidden":
        return f"unknown field; allowed: {', '.join(allowed)}" if allowed else "unknown field"
    return error.get("msg", "invalid").removeprefix("Value error, ")


def short_repr(value: Any, limit: int = 60) -> str:
    """repr(value), cut to about `limit` characters (without building the whole of it)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    if isinstance(value, (list, dict)) and len(value) > 8:
        kind = "list" if isinstance(value, list) else "object"
        return f"a {kind} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."
