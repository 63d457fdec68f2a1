"""What every child process of the server shares: how it is started (a plain
`python -m module` with the server args as JSON, so nothing is pickled), the resolved model as
its first message, and that it dies with its parent."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from spectral import faults
from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel
from spectral.server import messages  # noqa: F401  (registers the message types)
from spectral.server.ipc import recv_message, send_message


def spawn_child(
    module: str, args: ServerArgs, ipc_dir: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start `python -m module` with the server args as JSON (its model follows as a message:
    `hand_model`), with `env` added to this process's environment."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            "--ipc-dir",
            ipc_dir,
            "--args-json",
            json.dumps(dataclasses.asdict(args)),
        ],
        env={**os.environ, **(env or {})},
    )


def parse_child_args(role: str) -> tuple[ServerArgs, argparse.Namespace]:
    """Parse a child's command line, set up its logging, and tie its life to its parent's."""
    ap = argparse.ArgumentParser(description=f"spectral {role} process (started by spectral)")
    ap.add_argument("--ipc-dir", required=True)
    ap.add_argument("--args-json", required=True)
    ns = ap.parse_args()
    args = ServerArgs(**json.loads(ns.args_json))
    faults.enable(args.fault_injection)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {role}: %(message)s")
    die_with_parent()
    return args, ns


def hand_model(ctx: zmq.Context, ipc_dir: str, role: str, model: ResolvedModel) -> zmq.Socket:
    """Send a child (started or about to start) the resolved model, its first message. The
    message waits in the socket until the child listens: keep the socket open until the child
    is ready, then close it."""
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"ipc://{ipc_dir}/model_{role}")
    send_message(sock, model)
    return sock


def receive_model(ipc_dir: str, role: str) -> ResolvedModel:
    """The resolved model the starting process hands this child (exits if that process dies
    first). The starting process resolves it while this one imports its modules."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.bind(f"ipc://{ipc_dir}/model_{role}")
    if not wait_for_work(sock, os.getppid()):
        sys.exit(f"spectral {role}: the process that started it is gone")
    model = recv_message(sock)
    sock.close(0)
    if not isinstance(model, ResolvedModel):
        raise RuntimeError(f"{role}: expected the resolved model first, got {type(model).__name__}")
    return model


def wait_for_work(sock: Any, parent: int, watch: Callable[[], None] | None = None) -> bool:
    """Block until `sock` has a message (True) or this process's parent `parent` is gone
    (False), a backstop for the parent-death signal. `watch`, where given, runs before every
    poll (it may end the process: a worker watching processes of its own)."""
    while True:
        if watch is not None:
            watch()
        if sock.poll(500):
            return True
        if os.getppid() != parent:
            return False


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def exit_on_sigterm() -> None:
    """SIGTERM exits this process through its `finally` blocks (SystemExit), once: a second
    SIGTERM (a process group signalled, then each child by the launcher) is ignored, so that it
    cannot break off the shutdown that the first began (stopping the worker)."""

    def exit_once(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(0)

    signal.signal(signal.SIGTERM, exit_once)


def stop_children(children: Iterable[subprocess.Popen]) -> None:
    """SIGTERM every child still running, then wait for each (SIGKILL after 10 s)."""
    children = list(children)
    for proc in children:
        if proc.poll() is None:
            proc.terminate()
    for proc in children:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
