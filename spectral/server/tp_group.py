"""Tensor-parallel ranks as processes (docs/internals.md, "Tensor parallelism").

Rank 0 is the server's worker process. It starts the other ranks of its machine as children
(`--nnodes` > 1: the other machines' `spectral serve --node-rank R` start theirs, `serve_node`)
and publishes every scheduler batch to all ranks on one socket before running it (ipc on one
machine, tcp at `--dist-init-addr`'s PORT + 1 across machines). Each rank subscribes with a
topic naming it, so rank 0 learns which ranks are there (it waits for all of them) and which one
went away (its socket closed: the process died). Ranks on another machine are told rank 0 is
alive by a heartbeat; without one for HEARTBEAT_TIMEOUT_S they exit. The ranks meet in one
torch.distributed group (gloo on CPUs, NCCL on GPUs) with one random stream.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import zmq

from spectral.args import ServerArgs
from spectral.mem.process import freeze_heap
from spectral.server.child import hand_model, spawn_child, stop_children, wait_for_work
from spectral.server.ipc import recv_message, send_message
from spectral.server.messages import GrammarQuery, Heartbeat

logger = logging.getLogger(__name__)

# A tensor-parallel rank's number, set in the environment of the rank processes started.
TP_RANK_ENV = "SPECTRAL_TP_RANK"
TP_TIMEOUT_S = 60  # a collective (or rank 0's wait for the ranks) that waits longer fails
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
WORKER_MODULE = "spectral.server.worker_process"


TOPIC = b"\xffrank"  # + the rank's number: a topic never published, naming a subscriber


def _topic(rank: int) -> bytes:
    return TOPIC + str(rank).encode()


def batch_endpoint(args: ServerArgs, ipc_dir: str) -> str:
    """Where rank 0 publishes batches: its machine's ipc directory, or PORT + 1 of
    --dist-init-addr where the ranks span machines."""
    if args.nnodes == 1:
        return f"ipc://{ipc_dir}/tp_batches"
    host, _, port = args.dist_init_addr.rpartition(":")
    return f"tcp://{host}:{int(port) + 1}"


def join_group(args: ServerArgs, ipc_dir: str, rank: int):
    """This rank's TensorParallel (None without tensor parallelism): the group's backend is
    NCCL where the model runs on GPUs (one a rank), else gloo; each rank takes its share of
    the cores; every rank seeds its random stream with rank 0's seed."""
    if args.tp_size == 1:
        return None
    import torch
    import torch.distributed as dist

    from spectral.layers.parallel import TensorParallel

    if args.num_threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks_per_node))
    backend = "gloo"
    if args.resolved_device().startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    init = f"file://{ipc_dir}/tp_rendezvous"
    if args.nnodes > 1:
        init = f"tcp://{args.dist_init_addr}"
    dist.init_process_group(
        backend,
        init_method=init,
        rank=rank,
        world_size=args.tp_size,
        timeout=datetime.timedelta(seconds=TP_TIMEOUT_S),
    )
    tp = TensorParallel(rank, args.tp_size)
    # One random stream on every rank: unseeded sampling, verification's included, draws the
    # same on each, so every rank accepts the same drafts and keeps the same slots.
    seed = args.random_seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,))) if rank == 0 else 0
    torch.manual_seed(tp.broadcast(seed))
    return tp


class RankFanout:
    """Rank 0's side: the local ranks it started and the socket every rank takes batches
    from."""

    def __init__(self, args: ServerArgs, ipc_dir: str, ctx: zmq.Context, model) -> None:
        """Bind the batch socket, then start ranks 1..ranks_per_node-1 and hand them
        `model`."""
        self.args = args
        self.socket = ctx.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, repeats too
        self.socket.bind(batch_endpoint(args, ipc_dir))
        self.ranks: dict[int, subprocess.Popen] = {}
        self._handed: list[zmq.Socket] = []
        for r in range(1, args.ranks_per_node):
            self.ranks[r] = spawn_child(WORKER_MODULE, args, ipc_dir, {TP_RANK_ENV: str(r)})
            self._handed.append(hand_model(ctx, ipc_dir, f"worker{r}", model))
        self._present: set[int] = set()
        self._beat = time.monotonic()

    def wait_for_ranks(self) -> None:
        """Until every rank has subscribed (after the group formed, all are running)."""
        deadline = time.monotonic() + TP_TIMEOUT_S
        while len(self._present) < self.args.tp_size - 1:
            if time.monotonic() > deadline:
                missing = set(range(1, self.args.tp_size)) - self._present
                raise RuntimeError(f"tensor-parallel ranks {sorted(missing)} never subscribed")
            self.watch(timeout_ms=100)
        for sock in self._handed:
            sock.close(0)

    def publish(self, batch) -> None:
        send_message(self.socket, batch)
        self._beat = time.monotonic()

    def watch(self, timeout_ms: int = 0) -> None:
        """End this process (and so the server: the scheduler watches it) naming a rank that
        is gone: a local one that exited, or any whose socket closed; across machines, tell
        the ranks rank 0 is alive."""
        for r, proc in self.ranks.items():
            if proc.poll() is not None:
                logger.error("tensor-parallel rank %d exited with code %s", r, proc.returncode)
                sys.exit(f"spectral worker: tensor-parallel rank {r} exited with {proc.returncode}")
        while self.socket.poll(timeout_ms):
            event = self.socket.recv()
            timeout_ms = 0
            topic = event[1:]
            if not topic.startswith(TOPIC):
                continue
            rank = int(topic[len(TOPIC) :])
            if event[0] == 1:
                self._present.add(rank)
            elif rank in self._present:
                logger.error("tensor-parallel rank %d went away (its connection closed)", rank)
                sys.exit(f"spectral worker: tensor-parallel rank {rank} went away")
        if self.args.nnodes > 1 and time.monotonic() - self._beat > HEARTBEAT_S:
            self.publish(Heartbeat())


def rank_main(args: ServerArgs, ipc_dir: str, rank: int, model, ctx: zmq.Context) -> None:
    """Rank 1..N-1: run every batch rank 0 publishes (speculative rounds too: the drafter is
    replicated, and every rank verifies alike); the results are rank 0's to send. A failed
    batch ends the rank (its group is out of step), and so the server."""
    from spectral.worker.factory import create_worker

    inbox = ctx.socket(zmq.SUB)
    inbox.connect(batch_endpoint(args, ipc_dir))
    inbox.setsockopt(zmq.SUBSCRIBE, b"")
    inbox.setsockopt(zmq.SUBSCRIBE, _topic(rank))  # names this rank to rank 0
    worker = create_worker(args, model, join_group(args, ipc_dir, rank))
    if worker.grammars is not None:  # speculative: each rank masks its trees itself
        worker.grammars.backend.start()
    freeze_heap()
    parent = os.getppid()
    seen = [time.monotonic()]

    def rank0_alive() -> None:
        if args.nnodes > 1 and time.monotonic() - seen[0] > HEARTBEAT_TIMEOUT_S:
            sys.exit(f"spectral worker: tensor-parallel rank {rank}: rank 0 is gone")

    while wait_for_work(inbox, parent, rank0_alive):
        batch = recv_message(inbox)
        seen[0] = time.monotonic()
        if isinstance(batch, Heartbeat):
            continue
        if isinstance(batch, GrammarQuery):  # rank 0 answers; this rank starts its compile
            worker.grammar_ready(batch.kind, batch.text)
            continue
        worker.forward(batch)


def serve_node(args: ServerArgs) -> None:
    """`spectral serve --nnodes N --node-rank R` (R > 0): start this machine's ranks, hand
    them the model, and exit when one does (SIGTERM stops them all)."""
    from spectral.models.resolved import resolve_model

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    ipc_dir = tempfile.mkdtemp(prefix="spectral-")  # mode 0700
    ctx = zmq.Context()
    first = args.node_rank * args.ranks_per_node
    ranks = {
        r: spawn_child(WORKER_MODULE, args, ipc_dir, {TP_RANK_ENV: str(r)})
        for r in range(first, first + args.ranks_per_node)
    }
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    code = 0
    try:
        model, _ = resolve_model(args)
        handed = [hand_model(ctx, ipc_dir, f"worker{r}", model) for r in ranks]
        logger.info("node %d: tensor-parallel ranks %s started", args.node_rank, list(ranks))
        while not any(proc.poll() is not None for proc in ranks.values()):
            time.sleep(0.2)
        for r, proc in ranks.items():
            if proc.poll() is not None:
                logger.error("tensor-parallel rank %d exited with code %s", r, proc.returncode)
                code = 1
        for sock in handed:
            sock.close(0)
    except KeyboardInterrupt:
        pass
    finally:
        stop_children(ranks.values())
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
    sys.exit(code)
