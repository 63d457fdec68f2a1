"""The message types that cross process boundaries, registered with the IPC codec.

Types defined below the server (the worker's batch and result) are registered here, so that
nothing outside `spectral.server` needs to import it.
"""

from __future__ import annotations

from spectral.forward import ForwardMode
from spectral.sampling_params import SamplingParams
from spectral.server.ipc import message, register_enum
from spectral.worker.io import RequestSampling, WorkerBatch, WorkerResult

register_enum(ForwardMode)
for cls in (SamplingParams, RequestSampling, WorkerBatch, WorkerResult):
    message(cls)
