"""A server's processes: the detokenizer and the scheduler (which holds the model worker, or
starts its process), each handed the resolved model and waited for until it reports ready.
What serves HTTP in front of them is the entry point's (spectral.launch_server)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel
from spectral.models.registry import UnsupportedModelError, check_model_dir
from spectral.models.resolve import ModelNotFoundError, model_files_dir
from spectral.server.child import hand_model, spawn_child, stop_children
from spectral.server.ipc import recv_message
from spectral.server.messages import ProcessReady

READY_TIMEOUT_S = 900


def check_model_files(args: ServerArgs) -> None:
    """Exit naming the problem if the model's files are missing or of an unsupported model (a
    GGUF's are extracted here, once), before any child starts."""
    try:
        check_model_dir(model_files_dir(args.model_path, args.model_cache_dir))
    except (ModelNotFoundError, UnsupportedModelError) as err:
        sys.exit(f"spectral: {err}")


class ServerProcesses:
    """The detokenizer and scheduler processes of one server and the private ipc directory
    they talk in. They start at construction, importing their modules while this process
    resolves the model (`start`); whoever constructs this calls `close()`, whatever happens."""

    def __init__(self, args: ServerArgs) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="spectral-")  # mode 0700
        self.ctx = zmq.Context()
        self._ready = self.ctx.socket(zmq.PULL)
        self._ready.bind(f"ipc://{self.ipc_dir}/ready")
        self._model_out: list[zmq.Socket] = []
        self.children = {
            "detokenizer": spawn_child("spectral.server.detokenizer_process", args, self.ipc_dir),
            "scheduler": spawn_child("spectral.server.scheduler_process", args, self.ipc_dir),
        }

    def start(self, args: ServerArgs) -> tuple[ResolvedModel, Any, dict[str, Any]]:
        """Resolve the model, hand it to every child (the model worker too, which the scheduler
        has started) and wait until they are ready: the model, its tokenizer, and what the
        scheduler reported (`num_kv_slots`). RuntimeError if a child exits first, the wait
        passes READY_TIMEOUT_S, or the model cannot be resolved."""
        from spectral.models.resolved import resolve_model

        try:
            model, tokenizer = resolve_model(args)
        except (ModelNotFoundError, UnsupportedModelError) as err:
            raise RuntimeError(f"spectral: {err}") from None
        roles = [*self.children, *(["worker"] if args.worker_in_own_process() else [])]
        self._model_out = [hand_model(self.ctx, self.ipc_dir, role, model) for role in roles]
        info = _wait_ready(self._ready, self.children)["scheduler"]
        for sock in self._model_out:
            sock.close(0)
        self._ready.close(0)
        return model, tokenizer, info

    def exited(self) -> tuple[str, int] | None:
        """(name, exit code) of a child that has exited, None while all run."""
        for name, proc in self.children.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def close(self) -> None:
        """Stop every child, close the sockets and remove the ipc directory."""
        stop_children(self.children.values())
        for sock in [self._ready, *self._model_out]:
            sock.close(0)  # an open socket would keep ctx.term() waiting forever
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _wait_ready(sock: zmq.Socket, children: dict[str, subprocess.Popen]) -> dict[str, dict]:
    ready: dict[str, dict] = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(ready) < len(children):
        for name, proc in children.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the {name} process exited with code {proc.returncode} while starting"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"processes not ready after {READY_TIMEOUT_S} s: {set(children) - set(ready)}"
            )
        if sock.poll(200):
            msg = recv_message(sock)
            if isinstance(msg, ProcessReady):
                ready[msg.role] = msg.info
    return ready
