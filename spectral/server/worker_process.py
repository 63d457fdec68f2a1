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
from dataclasses import dataclass

import zmq

from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel
from spectral.core.worker_io import WorkerBatch, WorkerResult
from spectral.faults import RemoteError, WorkerLostError
from spectral.server import messages  # noqa: F401  (registers the message types)
from spectral.server.child import (
    hand_model,
    parse_child_args,
    receive_model,
    spawn_child,
    wait_for_work,
)
from spectral.server.ipc import message, recv_message, send_message
from spectral.speculative.cost_model import CostModel

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600
WORKER_MODULE = "spectral.server.worker_process"  # run as a module: its __name__ is __main__


@message
@dataclass
class WorkerReady:
    num_kv_slots: int
    # What speculative rounds cost there (CostModel.to_dict), for the scheduler's tree planner
    cost_model: dict | None = None


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


class WorkerDiedError(WorkerLostError):
    """The worker process is gone; the message says how it ended."""


class WorkerStepError(RemoteError):
    """The worker failed on one batch; the scheduler fails that batch's requests."""


# A tensor-parallel rank's number, set by rank 0 in the environment of the ranks it starts.
TP_RANK_ENV = "SPECTRAL_TP_RANK"
TP_TIMEOUT_S = 60  # a collective that waits longer than this for a rank fails


def worker_main(args: ServerArgs, ipc_dir: str) -> None:
    """The model worker. With --tp-size N, this process is rank 0: it starts ranks 1..N-1 (its
    children), hands them the model, joins them in a gloo group, and passes every batch the
    scheduler sends on to them before running it; only rank 0 answers (every rank computes
    the same gathered logits and samples the same tokens)."""
    from spectral.worker.factory import create_worker

    rank = int(os.environ.get(TP_RANK_ENV, "0"))
    role = "worker" if rank == 0 else f"worker{rank}"
    model = receive_model(ipc_dir, role)
    ctx = zmq.Context()
    if rank:
        return _rank_main(args, ipc_dir, rank, model, ctx)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{ipc_dir}/worker_in")
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(f"ipc://{ipc_dir}/worker_out")
    ranks, peers, handed = [], [], []
    for r in range(1, args.tp_size):
        ranks.append(spawn_child(WORKER_MODULE, args, ipc_dir, {TP_RANK_ENV: str(r)}))
        handed.append(hand_model(ctx, ipc_dir, f"worker{r}", model))
        peer = ctx.socket(zmq.PUSH)
        peer.connect(f"ipc://{ipc_dir}/rank{r}_in")
        peers.append(peer)
    try:
        worker = create_worker(args, model, _join_group(args, ipc_dir, 0))
    except Exception as err:
        send_message(outbox, WorkerFailed(f"{type(err).__name__}: {err}"))
        raise
    for sock in handed:
        sock.close(0)
    cost = worker.cost_model
    send_message(outbox, WorkerReady(worker.num_kv_slots, cost.to_dict() if cost else None))
    if worker.grammars is not None:  # speculative: the worker follows grammar requests itself
        worker.grammars.backend.start()
    parent = os.getppid()
    watch = (lambda: _exit_if_a_rank_died(ranks)) if ranks else None
    while wait_for_work(inbox, parent, watch):
        batch = recv_message(inbox)
        for peer in peers:
            send_message(peer, batch)
        try:
            reply = worker.forward(batch)
        except Exception as err:  # one batch's failure must not end the process
            logger.exception("the model worker failed on a batch")
            reply = StepFailed(f"{type(err).__name__}: {err}")
        send_message(outbox, reply)


def _exit_if_a_rank_died(ranks: list[subprocess.Popen]) -> None:
    """End rank 0 (and so the server: the scheduler watches it) naming a rank that exited."""
    for r, proc in enumerate(ranks, start=1):
        if proc.poll() is not None:
            logger.error("tensor-parallel rank %d exited with code %s", r, proc.returncode)
            sys.exit(f"spectral worker: tensor-parallel rank {r} exited with {proc.returncode}")


def _join_group(args: ServerArgs, ipc_dir: str, rank: int):
    """This rank's place in the tensor-parallel group (None without tensor parallelism); each
    rank takes its share of the cores."""
    if args.tp_size == 1:
        return None
    import datetime

    import torch
    import torch.distributed as dist

    from spectral.layers.parallel import TensorParallel

    if args.num_threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp_size))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{ipc_dir}/tp_rendezvous",
        rank=rank,
        world_size=args.tp_size,
        timeout=datetime.timedelta(seconds=TP_TIMEOUT_S),
    )
    # One random stream on every rank (rank 0's seed): unseeded sampling, verification's
    # included, draws the same on each, so every rank accepts the same drafts and keeps the
    # same slots.
    seed = torch.tensor([args.random_seed if args.random_seed is not None else 0])
    if args.random_seed is None and rank == 0:
        seed = torch.randint(0, 2**62, (1,))
    dist.broadcast(seed, 0)
    torch.manual_seed(int(seed))
    return TensorParallel(rank, args.tp_size)


def _rank_main(args: ServerArgs, ipc_dir: str, rank: int, model, ctx: zmq.Context) -> None:
    """Rank 1..N-1: run every batch rank 0 passes on (speculative rounds too: the drafter is
    replicated, and every rank verifies alike); the results are rank 0's to send."""
    from spectral.worker.factory import create_worker

    inbox = ctx.socket(zmq.PULL)
    inbox.bind(f"ipc://{ipc_dir}/rank{rank}_in")
    worker = create_worker(args, model, _join_group(args, ipc_dir, rank))
    if worker.grammars is not None:  # speculative: each rank masks its trees itself
        worker.grammars.backend.start()
    parent = os.getppid()
    while wait_for_work(inbox, parent):
        batch = recv_message(inbox)
        try:
            worker.forward(batch)
        except Exception:  # rank 0 fails the same batch and answers for it
            logger.exception("tensor-parallel rank %d failed on a batch", rank)


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
        self.cost_model = CostModel.from_dict(ready.cost_model) if ready.cost_model else None
        return self

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

    def forward(self, batch: WorkerBatch) -> WorkerResult:
        send_message(self.batches, batch)
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
