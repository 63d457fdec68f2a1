"""Per-request sampling parameters, with SGLang's names, validated once on arrival.

`SamplingParams` is what the runtime carries (its defaults are the only statement of them);
`SamplingParamsModel` is the one statement of what each may be, published in the OpenAPI
document and checked by `from_dict` and `validate`: the engine and the server refuse alike.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

import regex
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
# The most parallel samples (`n`) per prompt; a server's --max-request-sequences bounds prompts x n.
MAX_N = 128
# A stop regex is searched in the output after every new token; one that backtracks for longer
# than this finishes its request with an error instead of stalling the scheduler.
STOP_REGEX_TIMEOUT_S = 0.05
# The structured-output parameters: at most one per request.
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")


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
    n: int = 1
    stop_regex: list[str] = field(default_factory=list)
    spaces_between_special_tokens: bool = True
    # Structured output: at most one grammar the output must follow (xgrammar's dialects).
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # A streamed request's new tokens go out every this many (None: the server's
    # --stream-interval).
    stream_interval: int | None = None

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, or None."""
        for kind in GRAMMAR_KINDS:
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None, where: str = "") -> SamplingParams:
        """Validated parameters from a client's dict (None and missing keys take defaults)."""
        return check_model(SamplingParamsModel, params or {}, where).to_params()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError unless every field is allowed (and, given the vocabulary
        size, every stop token id is in it). A grammar's text is not parsed again: it was when
        the parameters were made from the client's dict, and the scheduler compiles it."""
        check_model(SamplingParamsModel, dataclasses.asdict(self), parse_grammar=False)
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"stop_token_ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                    "stop_token_ids",
                )

    def for_sample(self, k: int) -> SamplingParams:
        """The parameters of the k-th of `n` samples: a different seed when one was given, so
        that the samples differ (kept within 64 bits)."""
        if k == 0 or self.seed is None:
            return self
        seed = (self.seed + k - INT64_MIN) % 2**64 + INT64_MIN
        return dataclasses.replace(self, seed=seed)

    def decode(self, tokenizer: Any, ids: list[int]) -> str:
        """`ids` as text the way this request shows it (special tokens skipped or not)."""
        return tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def search_stop_regex(self, text: str, partial: bool = False) -> regex.Match | None:
        """The earliest match of any stop regex in `text` (None without one); with `partial`,
        also a match that the end of `text` cuts short (`.partial` set), which more text may
        complete. Raises InvalidRequestError when a pattern backtracks past
        STOP_REGEX_TIMEOUT_S."""
        best = None
        for pattern in self.stop_regex:
            try:
                found = regex.search(pattern, text, partial=partial, timeout=STOP_REGEX_TIMEOUT_S)
            except TimeoutError:
                raise InvalidRequestError(
                    f"stop_regex {short_repr(pattern)} took longer than "
                    f"{STOP_REGEX_TIMEOUT_S * 1000:.0f} ms to search the output; simplify it",
                    "stop_regex",
                ) from None
            if found is not None and (best is None or found.start() < best.start()):
                best = found
        return best

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


def _compiles(pattern: str) -> str:
    try:
        regex.compile(pattern)
    except regex.error as err:
        raise ValueError(f"not a valid regular expression: {err}") from None
    return pattern


GrammarText = text(min_length=1, max_length=2**20)
StopRegex = Annotated[text(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_compiles)]
StopRegexes = StopRegex | Annotated[list[StopRegex], Field(max_length=MAX_STOP_STRINGS)]
# SGLang's sampling parameters that spectral does not act on: accepted while null (or empty),
# refused with a 400 that names them otherwise.
UNSUPPORTED_SAMPLING = {
    "structural_tag": "structural tags are not supported",
    "custom_params": "custom logit processors are not supported",
    "logit_bias": "logit_bias is not supported",
}

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
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N, description="parallel samples")] = _D.n
    stop_regex: StopRegexes | None = None
    spaces_between_special_tokens: Flag = _D.spaces_between_special_tokens
    regex: GrammarText | None = Field(None, description="the output fully matches this regex")
    json_schema: GrammarText | None = Field(
        None, description="the output is JSON valid under this schema (a JSON string)"
    )
    ebnf: GrammarText | None = Field(None, description="the output follows this EBNF grammar")
    structural_tag: Any = Field(None, description=UNSUPPORTED_SAMPLING["structural_tag"])
    custom_params: Any = Field(None, description=UNSUPPORTED_SAMPLING["custom_params"])
    logit_bias: Any = Field(None, description=UNSUPPORTED_SAMPLING["logit_bias"])
    stream_interval: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)] | None = Field(
        None, description="a stream's new tokens go out every this many (default: the server's)"
    )

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
            if "sampling_seed" in data:  # SGLang's name
                data.setdefault("seed", data.pop("sampling_seed"))
        return data

    @model_validator(mode="after")
    def _one_grammar_that_compiles(self, info: ValidationInfo) -> SamplingParamsModel:
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind)]
        if len(given) > 1:
            raise InvalidRequestError(
                f"{given[1]}: only one of regex, json_schema or ebnf may be given (got "
                f"{' and '.join(given)})",
                given[1],
            )
        if given and (info.context or {}).get("parse_grammar", True):
            from spectral.constrained import grammar_error

            why = grammar_error(given[0], getattr(self, given[0]))
            if why is not None:
                raise InvalidRequestError(f"{given[0]}: xgrammar cannot use it: {why}", given[0])
        return self

    @field_validator(*UNSUPPORTED_SAMPLING)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> None:
        if value not in (None, {}):
            raise ValueError(f"{UNSUPPORTED_SAMPLING[info.field_name]}; send null or leave it out")
        return None

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
        values = {
            k: getattr(self, k) for k in type(self).model_fields if k not in UNSUPPORTED_SAMPLING
        }
        values["stop"] = self.stop_list()
        values["stop_token_ids"] = list(self.stop_token_ids or [])
        stop_regex = self.stop_regex or []
        values["stop_regex"] = [stop_regex] if isinstance(stop_regex, str) else list(stop_regex)
        return SamplingParams(**values)


def check_model(model: type[BaseModel], data: Any, where: str = "", **context: Any) -> Any:
    """`model.model_validate(data)` (validators see `context`), with a failure turned into
    InvalidRequestError."""
    try:
        return model.model_validate(data, context=context or None)
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
    for e in errors:  # a validator that names the field itself
        named = (e.get("ctx") or {}).get("error")
        if isinstance(named, InvalidRequestError):
            outer = ".".join([where] * bool(where) + _field_path(e))
            prefix = f"{outer}." if outer else ""
            return InvalidRequestError(
                f"invalid request: {prefix}{named}", prefix + (named.param or "") or None
            )
    by_path: dict[str, list[dict[str, Any]]] = {}
    for e in errors:
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "")
            return InvalidRequestError(f"invalid request: the body is not JSON ({reason})")
        path = ".".join([where] * bool(where) + _field_path(e)) or "body"
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


def _field_path(error: dict[str, Any]) -> list[str]:
    """The fields and indices of a pydantic error's location (no "body", no union branches)."""
    parts = [str(p) for p in error.get("loc", ()) if p != "body"]
    return [p for p in parts if not (_UNION_TAG.search(p) and not p.isdigit())]


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
