"""What every child process of the server shares: how it is started (a plain
`python -m module` with the server args as JSON, so nothing is pickled), how it reads its
arguments, and that it dies with its parent."""

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
from typing import Any

from spectral import faults
from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel


def spawn_child(
    module: str, args: ServerArgs, model: ResolvedModel, ipc_dir: str
) -> subprocess.Popen:
    """Start `python -m module` with the server args and the resolved model as JSON."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            "--ipc-dir",
            ipc_dir,
            "--args-json",
            json.dumps(dataclasses.asdict(args)),
            "--model-json",
            model.to_json(),
        ]
    )


def parse_child_args(role: str) -> tuple[ServerArgs, ResolvedModel, argparse.Namespace]:
    """Parse a child's command line, set up its logging, and tie its life to its parent's."""
    ap = argparse.ArgumentParser(description=f"spectral {role} process (started by spectral)")
    ap.add_argument("--ipc-dir", required=True)
    ap.add_argument("--args-json", required=True)
    ap.add_argument("--model-json", required=True)
    ns = ap.parse_args()
    args = ServerArgs(**json.loads(ns.args_json))
    faults.enable(args.fault_injection)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {role}: %(message)s")
    die_with_parent()
    return args, ResolvedModel.from_json(ns.model_json), ns


def wait_for_work(sock: Any, parent: int) -> bool:
    """Block until `sock` has a message (True) or this process's parent `parent` is gone
    (False), a backstop for the parent-death signal."""
    while not sock.poll(500):
        if os.getppid() != parent:
            return False
    return True


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent exits (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
