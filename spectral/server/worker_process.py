"""The model worker in its own process, and the scheduler-side proxy that talks to it: one
`WorkerBatch` in and one `WorkerResult` out per step over ipc:// sockets. This module imports
nothing heavy, so that the scheduler process starts the worker (the longest load) first."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque

import zmq

from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel
from spectral.core.worker_io import MAX_LAUNCHED, WorkerBatch, WorkerResult
from spectral.faults import RemoteError, WorkerLostError
from spectral.mem.process import freeze_heap
from spectral.server.child import (
    hand_model,
    parse_child_args,
    receive_model,
    spawn_child,
    wait_for_work,
)
from spectral.server.ipc import recv_message, send_message
from spectral.server.messages import (
    CollectStep,
    GrammarQuery,
    GrammarStatus,
    LaunchStep,
    StepFailed,
    WorkerFailed,
    WorkerReady,
)
from spectral.server.tp_group import TP_RANK_ENV, WORKER_MODULE, RankFanout, join_group, rank_main
from spectral.speculative.cost_model import CostModel

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600


class WorkerDiedError(WorkerLostError):
    """The worker process is gone; the message says how it ended."""


class WorkerStepError(RemoteError):
    """The worker failed on one batch; the scheduler fails that batch's requests."""


def worker_main(args: ServerArgs, ipc_dir: str) -> None:
    """The model worker. With --tp-size N, this process is rank 0 (spectral.server.tp_group):
    it starts its machine's other ranks, hands them the model, joins them in one group, and
    publishes every batch the scheduler sends to the ranks before running it; only rank 0
    answers (every rank computes the same gathered logits and samples the same tokens)."""
    from spectral.worker.factory import create_worker

    rank = int(os.environ.get(TP_RANK_ENV, "0"))
    role = "worker" if rank == 0 else f"worker{rank}"
    model = receive_model(ipc_dir, role)
    ctx = zmq.Context()
    if rank:
        return rank_main(args, ipc_dir, rank, model, ctx)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{ipc_dir}/worker_in")
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(f"ipc://{ipc_dir}/worker_out")
    fanout = RankFanout(args, ipc_dir, ctx, model) if args.tp_size > 1 else None
    try:
        worker = create_worker(args, model, join_group(args, ipc_dir, 0))
        if fanout is not None:
            fanout.wait_for_ranks()
    except Exception as err:
        send_message(outbox, WorkerFailed(f"{type(err).__name__}: {err}"))
        raise
    cost = worker.cost_model
    pipeline = getattr(worker, "pipeline", None) if fanout is None else None
    ready = WorkerReady(
        worker.num_kv_slots,
        cost.to_dict() if cost else None,
        worker.graph_info(),
        worker.kv_pool_info(),
        launches=pipeline is not None,
    )
    freeze_heap()
    send_message(outbox, ready)
    if worker.grammars is not None:  # speculative: the worker follows grammar requests itself
        worker.grammars.backend.start()
    parent = os.getppid()
    launched: deque[StepFailed | None] = deque()  # per step out: None, or why it failed
    while wait_for_work(inbox, parent, fanout.watch if fanout else None):
        batch = recv_message(inbox)
        if fanout is not None:
            fanout.publish(batch)  # a GrammarQuery too: every rank masks its own trees
        if isinstance(batch, GrammarQuery):
            send_message(outbox, GrammarStatus(worker.grammar_ready(batch.kind, batch.text)))
            continue
        if isinstance(batch, LaunchStep):
            launched.append(_launch(pipeline, batch.batch))
            if len(launched) < MAX_LAUNCHED:
                continue
            batch = CollectStep()  # two out: the oldest one's answer goes now
        if isinstance(batch, CollectStep):
            failed = launched.popleft()
            send_message(outbox, failed if failed is not None else _collect(pipeline))
            continue
        try:
            reply = worker.forward(batch)
        except Exception as err:  # one batch's failure must not end the process
            logger.exception("the model worker failed on a batch")
            if fanout is not None:  # unless its ranks may now be out of step
                sys.exit(f"spectral worker: a tensor-parallel step failed: {err}")
            reply = StepFailed(f"{type(err).__name__}: {err}")
        send_message(outbox, reply)


def _launch(pipeline, batch: WorkerBatch) -> StepFailed | None:
    try:
        pipeline.launch(batch)
    except Exception as err:  # answered when the step is collected
        logger.exception("the model worker failed to launch a decode step")
        return StepFailed(f"{type(err).__name__}: {err}")
    return None


def _collect(pipeline) -> WorkerResult | StepFailed:
    try:
        return pipeline.collect()
    except Exception as err:
        logger.exception("the model worker failed on a decode step launched ahead")
        return StepFailed(f"{type(err).__name__}: {err}")


class RemotePipeline:
    """The worker process's DecodePipeline seen from the scheduler: `launch` sends the step,
    `collect` receives the oldest one's answer (asking for it where only one is out)."""

    def __init__(self, remote: RemoteWorker) -> None:
        self.remote = remote
        self.out = 0

    def launch(self, batch: WorkerBatch) -> None:
        send_message(self.remote.batches, LaunchStep(batch))
        self.out += 1

    def collect(self) -> WorkerResult:
        if self.out == 0:
            raise RuntimeError("no step was launched")
        if self.out < MAX_LAUNCHED:  # the worker answers by itself only with two out
            send_message(self.remote.batches, CollectStep())
        self.out -= 1
        return self.remote.answer()


class RemoteWorker:
    """`forward(WorkerBatch) -> WorkerResult` against a worker process it starts and owns.
    The process starts at construction; `wait_ready()` (before the first forward) waits for it
    to load, so the caller can do its own start-up meanwhile."""

    grammars = None  # the worker process follows grammars itself (the Worker interface)

    def __init__(self, args: ServerArgs, ipc_dir: str) -> None:
        self.ipc_dir = ipc_dir
        self.cost_model: CostModel | None = None  # known once it is ready
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(f"ipc://{ipc_dir}/worker_out")
        self.process = spawn_child(WORKER_MODULE, args, ipc_dir)
        self._model_out: zmq.Socket | None = None
        self.batches = self.ctx.socket(zmq.PUSH)
        self.batches.connect(f"ipc://{ipc_dir}/worker_in")

    def hand_model(self, model: ResolvedModel) -> RemoteWorker:
        """Send the worker the resolved model (it waits for it after its imports; in a server
        the launching process sends it); returns self."""
        self._model_out = hand_model(self.ctx, self.ipc_dir, "worker", model)
        return self

    def wait_ready(self) -> RemoteWorker:
        """Wait until the worker has loaded (RuntimeError if it failed to); returns self."""
        ready = self._receive(READY_TIMEOUT_S)
        if isinstance(ready, WorkerFailed):
            self.close()
            raise RuntimeError(f"the model worker failed to start: {ready.error}")
        if self._model_out is not None:
            self._model_out.close(0)
        self.ready: WorkerReady = ready
        self.num_kv_slots = ready.num_kv_slots
        self.pipeline = RemotePipeline(self) if ready.launches else None
        self.cost_model = CostModel.from_dict(ready.cost_model) if ready.cost_model else None
        return self

    def graph_info(self) -> dict | None:
        return self.ready.graphs

    def _receive(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not self.results.poll(100):
            self.check_alive()
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"no answer from the model worker in {timeout_s:.0f} s")
        return recv_message(self.results)

    def check_alive(self) -> None:
        """Raise WorkerDiedError if the worker process has exited."""
        code = self.process.poll()
        if code is not None:
            raise WorkerDiedError(f"the model worker process exited with code {code}")

    def kv_pool_info(self) -> dict:
        return self.ready.kv_pool or {}

    def grammar_ready(self, kind: str, text: str) -> bool:
        send_message(self.batches, GrammarQuery(kind, text))
        return self._receive(READY_TIMEOUT_S).ready

    def forward(self, batch: WorkerBatch) -> WorkerResult:
        send_message(self.batches, batch)
        return self.answer()

    def answer(self) -> WorkerResult:
        """The worker's answer to a step (WorkerStepError where it failed on it)."""
        reply = self._receive(READY_TIMEOUT_S)
        if isinstance(reply, StepFailed):
            raise WorkerStepError(reply.error)
        return reply

    def close(self) -> None:
        """Stop the worker process (SIGTERM, then SIGKILL) and close the sockets."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._model_out is not None:
            self._model_out.close(0)
        self.batches.close(0)
        self.results.close(0)
        self.ctx.term()


def main() -> None:
    args, ns = parse_child_args("worker")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    worker_main(args, ns.ipc_dir)


if __name__ == "__main__":
    main()
