"""Every message type that crosses a process boundary, registered with the IPC codec and
grouped by the direction it travels (docs/internals.md, "Processes and IPC").

Types defined below the server (the request, the worker's batch and result, the resolved
model) are registered here too: importing this module is what makes them sendable.
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

# ---- start-up: launcher -> each child, then child -> launcher -------------------------------
# The launcher's first message to every child is its ResolvedModel (child.hand_model); the
# detokenizer and the scheduler answer ProcessReady when they can serve.

message(ResolvedModel)


@message
@dataclass
class ProcessReady:
    role: str
    info: dict[str, Any]


# ---- tokenizer manager -> scheduler ---------------------------------------------------------
# A TokenizedRequest (with its SamplingParams) per sequence, and these:

message(SamplingParams)
message(TokenizedRequest)


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


# ---- scheduler -> detokenizer ---------------------------------------------------------------
# BatchTokenIDOut each step with news; RequestRejected and ControlOut, which the detokenizer
# passes on to the tokenizer manager unchanged.


@message
@dataclass
class BatchTokenIDOut:
    """Per request with news this step: its new output ids, and when finished the reason and
    final counts."""

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
class RequestRejected:
    """A process refused or failed a request (the message says why): status 400 for a
    request that can never run, 500 for a failure while serving it. No output follows."""

    rid: str
    error: str
    status: int = 400


@message
@dataclass
class ControlOut:
    call_id: str
    result: dict[str, Any]


# ---- detokenizer -> tokenizer manager -------------------------------------------------------
# BatchStrOut, and the RequestRejected and ControlOut it passes on.


@message
@dataclass
class BatchStrOut:
    """BatchTokenIDOut with each request's text delta."""

    rids: list[str]
    text_deltas: list[str]
    new_ids: list[list[int]]
    new_logprobs: list[list[Any]]
    finished_reasons: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]


# ---- scheduler <-> model worker -------------------------------------------------------------
# One WorkerBatch in, one WorkerResult (or StepFailed) out per step, or a GrammarQuery in and
# a GrammarStatus out between steps; plain decode steps launched ahead as LaunchStep, their
# results out one step late (or at a CollectStep); WorkerReady or WorkerFailed once, at
# start-up. With tensor parallelism rank 0 publishes every WorkerBatch
# to the other ranks, and a Heartbeat while it has none for them.

register_enum(ForwardMode)
message(RequestSampling)
message(WorkerBatch)
message(WorkerResult)


@message
@dataclass
class WorkerReady:
    num_kv_slots: int
    # What speculative rounds cost there (CostModel.to_dict), for the scheduler's tree planner
    cost_model: dict | None = None
    # The graph runner's summary (ModelWorker.graph_info), for /get_server_info
    graphs: dict | None = None
    # The KV pool's bytes and commitment (Worker.kv_pool_info), for /get_server_info
    kv_pool: dict | None = None
    # Whether it launches plain decode steps ahead (LaunchStep)
    launches: bool = False


@message
@dataclass
class LaunchStep:
    """A plain decode step launched ahead (DecodeOverlap): the worker answers for the oldest
    step out once it has two, or when a CollectStep asks."""

    batch: WorkerBatch


@message
@dataclass
class CollectStep:
    """Answer for the oldest step launched ahead now."""


@message
@dataclass
class WorkerFailed:
    """The worker could not start (the message says why)."""

    error: str


@message
@dataclass
class StepFailed:
    """The worker raised on one batch (the message says what); it goes on serving."""

    error: str


@message
@dataclass
class GrammarQuery:
    """Whether the worker has compiled this grammar (it starts the compile if not): asked
    before a request under it joins, so that no step waits for a compile (speculation)."""

    kind: str
    text: str


@message
@dataclass
class GrammarStatus:
    ready: bool


@message
@dataclass
class Heartbeat:
    """Rank 0 is alive (sent to the ranks on other machines while it has no batch for them)."""
