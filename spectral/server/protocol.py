"""The native API's request and response bodies (pydantic), the limits every request is held
to, and the error body all routes share.

The models state types and hard bounds, and the OpenAPI document is generated from them;
`RequestLimits` checks the bounds a server is configured with (ServerArgs) after parsing, with
errors that name the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from spectral.args import ServerArgs
from spectral.sampling_params import (
    INT32_MAX,
    Count,
    Flag,
    InvalidRequestError,
    SamplingParams,
    SamplingParamsModel,
    Text,
    TokenId,
    short_repr,
    text,
)

# The hard ceiling of a request id; servers set a lower one (--max-rid-length).
MAX_RID_CHARS = 4096
Rid = text(min_length=1, max_length=MAX_RID_CHARS)


class RequestLimits:
    """How much one request may ask for: the request limits of ServerArgs, and their checks."""

    def __init__(self, args: ServerArgs | None = None) -> None:
        self.args = args or ServerArgs()

    @property
    def max_request_bytes(self) -> int:
        return self.args.max_request_bytes

    def check_sequences(self, count: int, what: str, param: str) -> None:
        if count > self.args.max_request_sequences:
            raise InvalidRequestError(
                f"{param}: the request starts {count} sequences ({what}); at most "
                f"{self.args.max_request_sequences} are allowed per request "
                "(--max-request-sequences)",
                param,
            )

    def check_rid(self, rid: str | None, param: str = "rid") -> None:
        if rid is not None and len(rid) > self.args.max_rid_length:
            raise InvalidRequestError(
                f"{param}: a request id may have at most {self.args.max_rid_length} characters "
                f"(got {short_repr(rid)})",
                param,
            )

    def check_top_logprobs(self, count: int, param: str) -> None:
        if count > self.args.max_top_logprobs_num:
            raise InvalidRequestError(
                f"{param}: at most {self.args.max_top_logprobs_num} top logprobs per token "
                f"(got {count})",
                param,
            )

    def check_sampling(self, params: SamplingParams, where: str = "sampling_params") -> None:
        """The stop strings and stop token ids are within their configured counts and sizes."""
        prefix = f"{where}." if where else ""
        for name in ("stop", "stop_token_ids"):
            count = len(getattr(params, name))
            if count > self.args.max_stop_strings:
                raise InvalidRequestError(
                    f"{prefix}{name}: at most {self.args.max_stop_strings} per request "
                    f"(got {count})",
                    prefix + name,
                )
        for i, stop in enumerate(params.stop):
            if len(stop) > self.args.max_stop_length:
                raise InvalidRequestError(
                    f"{prefix}stop.{i}: a stop string may have at most {self.args.max_stop_length} "
                    f"characters (got {short_repr(stop)})",
                    f"{prefix}stop",
                )


class GenerateRequest(BaseModel):
    """`POST /generate`: one prompt or a batch (`text` or `input_ids`, not both)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["text"], "properties": {"input_ids": {"type": "null"}}},
                {"required": ["input_ids"], "properties": {"text": {"type": "null"}}},
            ]
        },
    )

    text: Text | Annotated[list[Text], Field(min_length=1)] | None = None
    input_ids: (
        Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
        | None
    ) = None
    sampling_params: (
        SamplingParamsModel | Annotated[list[SamplingParamsModel], Field(min_length=1)] | None
    ) = None
    stream: Flag = False
    return_logprob: Flag = False
    top_logprobs_num: Count = 0
    logprob_start_len: int = Field(-1, strict=True, ge=-1, le=INT32_MAX)
    rid: Rid | Annotated[list[Rid], Field(min_length=1)] | None = None

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompt_count(self) -> int:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("give exactly one of text or input_ids", "text")
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)

    def checked(self, limits: RequestLimits) -> tuple[list[SamplingParams], list[str | None]]:
        """Each prompt's sampling parameters and request id, after checking that the lists
        line up with the prompts and every value is within `limits`."""
        n = self.prompt_count()
        limits.check_sequences(n, f"{n} prompts", "text" if self.text is not None else "input_ids")
        params = self.sampling_params
        if isinstance(params, list):
            if not self.is_batch or len(params) != n:
                raise InvalidRequestError(
                    f"sampling_params: {len(params)} given for {n} prompt(s); give one object "
                    "for all, or a list with one per prompt",
                    "sampling_params",
                )
            each = [p.to_params() for p in params]
        else:
            each = [(params or SamplingParamsModel()).to_params()] * n
        for i, p in enumerate(each):
            where = f"sampling_params.{i}" if isinstance(params, list) else "sampling_params"
            limits.check_sampling(p, where)
        rids: list[str | None]
        if isinstance(self.rid, list):
            if not self.is_batch or len(self.rid) != n:
                raise InvalidRequestError(
                    f"rid: {len(self.rid)} ids given for {n} prompt(s); give one per prompt",
                    "rid",
                )
            if len(set(self.rid)) != n:
                raise InvalidRequestError("rid: the ids of a batch must differ", "rid")
            rids = list(self.rid)
        elif self.rid is not None and self.is_batch:
            raise InvalidRequestError("rid: a batch needs a list of ids, one per prompt", "rid")
        else:
            rids = [self.rid] * n
        for i, rid in enumerate(rids):
            limits.check_rid(rid, f"rid.{i}" if isinstance(self.rid, list) else "rid")
        limits.check_top_logprobs(self.top_logprobs_num, "top_logprobs_num")
        if self.stream and self.is_batch:
            raise InvalidRequestError("stream: a streamed request takes one prompt", "stream")
        return each, rids


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: Rid


class MetaInfo(BaseModel):
    """What `meta_info` always holds; more keys come with logprobs and speculative decoding."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class ModelInfo(BaseModel):
    model_path: str
    is_generation: bool
    context_length: int | None


class MessageResponse(BaseModel):
    message: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


# A streamed answer (`stream: true`): server-sent events, each `data: <JSON chunk>`, the last
# `data: [DONE]`.
SSE: dict[str, Any] = {
    "content": {
        "text/event-stream": {
            "itemSchema": {
                "type": "object",
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                "required": ["data"],
            }
        }
    }
}


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
