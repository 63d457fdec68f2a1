"""The message types that cross process boundaries, registered with the IPC codec.

Types defined below the server (the worker's batch and result) are registered here, so that
nothing outside `spectral.server` needs to import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spectral.core.forward import ForwardMode
from spectral.core.model import ResolvedModel
from spectral.core.req import TokenizedRequest
from spectral.core.worker_io import RequestSampling, WorkerBatch, WorkerResult
from spectral.sampling_params import SamplingParams
from spectral.server.ipc import message, register_enum

register_enum(ForwardMode)
for cls in (
    ResolvedModel,
    SamplingParams,
    TokenizedRequest,
    RequestSampling,
    WorkerBatch,
    WorkerResult,
):
    message(cls)


@message
@dataclass
class AbortReq:
    rid: str


@message
@dataclass
class ControlReq:
    """A request for the scheduler itself: `flush_cache` or `server_info`."""

    call_id: str
    name: str


@message
@dataclass
class ControlOut:
    call_id: str
    result: dict[str, Any]


@message
@dataclass
class RequestRejected:
    """A process refused or failed a request (the message says why): status 400 for a
    request that can never run, 500 for a failure while serving it. No output follows."""

    rid: str
    error: str
    status: int = 400


@message
@dataclass
class BatchTokenIDOut:
    """Per request with news this step: its new output ids, and when finished the reason and
    final counts. Sent by the scheduler to the detokenizer."""

    rids: list[str]
    new_ids: list[list[int]]
    new_logprobs: list[list[Any]]
    finished_reasons: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]
    # A request's sampling parameters with its first news (how to show its text, where it
    # stops), None after.
    params: list[SamplingParams | None]


@message
@dataclass
class BatchStrOut:
    """The same, with text deltas. Sent by the detokenizer to the tokenizer manager."""

    rids: list[str]
    text_deltas: list[str]
    new_ids: list[list[int]]
    new_logprobs: list[list[Any]]
    finished_reasons: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]


@message
@dataclass
class ProcessReady:
    role: str
    info: dict[str, Any]
