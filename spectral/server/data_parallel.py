"""`spectral serve --dp-size N`: N spectral servers on loopback behind sglang-router (its
cache-aware policy sends requests that share a prefix where it is cached); servers elsewhere
join with `--worker-urls`. Details in docs/internals.md."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from spectral.args import ServerArgs

logger = logging.getLogger("spectral.dp")

START_TIMEOUT_S = 600.0
# The router's checks, tighter than its defaults (60 s between health checks, 3 failures) so
# that a dead server stops getting requests within seconds (its requests meanwhile go elsewhere
# through the router's retries and circuit breaker); two missed checks, not one, so that one
# check delayed past its 5-s timeout on a loaded machine does not take a serving server out.
ROUTER_FLAGS = [
    "--health-check-interval-secs",
    "2",
    "--health-failure-threshold",
    "2",
    "--cb-failure-threshold",
    "2",
    "--cb-timeout-duration-secs",
    "15",
    "--worker-startup-timeout-secs",
    "600",
]
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}


def worker_urls(args: ServerArgs) -> list[str]:
    """The servers elsewhere (`--worker-urls`, separated by commas or spaces)."""
    return [u for u in re.split(r"[,\s]+", args.worker_urls or "") if u]


def server_args(args: ServerArgs, index: int) -> ServerArgs:
    """The arguments of local server `index`: loopback, its own port, a share of the cores."""
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // args.dp_size)
    return dataclasses.replace(
        args,
        host="127.0.0.1",
        port=args.port + 1 + index,
        dp_size=1,
        worker_urls=None,
        num_threads=threads,
    )


def cli_flags(args: ServerArgs) -> list[str]:
    """`args` as launch_server flags (only those that differ from the defaults)."""
    flags = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        flags.extend([flag] if value is True else [flag, str(value)])
    return flags


def ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections and to binds on port 0."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port(count: int = 1) -> int:
    """A port p with p .. p + count - 1 all free now, outside the ephemeral range: a server
    binds its port seconds after it is chosen, and a port from that range may meanwhile become
    some client connection's local end."""
    ephemeral = ephemeral_ports()
    low, high = (
        (10000, ephemeral.start - count)
        if ephemeral.start > 12000
        else (ephemeral.stop, 65535 - count)
    )
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randint(low, high)
        try:
            with contextlib.ExitStack() as stack:
                for p in range(port, port + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports between {low} and {high}")


def wait_healthy(url: str, proc: subprocess.Popen, path: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode} while starting")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become ready in {START_TIMEOUT_S:.0f} s")


def serve_data_parallel(args: ServerArgs) -> None:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--dp-size and --worker-urls need sglang-router: pip install 'spectral[router]'"
        ) from None
    servers: list[tuple[str, subprocess.Popen]] = []
    router: subprocess.Popen | None = None
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    exit_code = 0
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for i in range(args.dp_size if args.dp_size > 1 or not args.worker_urls else 0):
            sub = server_args(args, i)
            cmd = [sys.executable, "-m", "spectral.launch_server", *cli_flags(sub)]
            servers.append((f"http://127.0.0.1:{sub.port}", subprocess.Popen(cmd)))
        for url, proc in servers:
            wait_healthy(url, proc, "/health", deadline)
            logger.info("server %s is up", url)
        urls = [url for url, _ in servers] + worker_urls(args)
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *urls,
            "--policy",
            args.router_policy,
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            ROUTER_LOG_LEVELS.get(args.log_level, "info"),
            *ROUTER_FLAGS,
        ]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        router = subprocess.Popen(cmd)
        router_url = f"http://{args.host}:{args.port}"
        wait_healthy(router_url, router, "/readiness", deadline)
        logger.info(
            "serving on %s: sglang-router (%s) over %s", router_url, args.router_policy, urls
        )
        reported: set[str] = set()
        while not stopping:
            if router.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {router.returncode}")
            for url, proc in servers:
                if proc.poll() is not None and url not in reported:
                    reported.add(url)
                    logger.error(
                        "server %s exited with code %s; the router sends its requests to the "
                        "other servers",
                        url,
                        proc.returncode,
                    )
            if servers and len(reported) == len(servers) and not worker_urls(args):
                raise RuntimeError("every server has exited")
            time.sleep(0.5)
    except RuntimeError as err:
        logger.error("%s; shutting down", err)
        exit_code = 1
    finally:
        _stop([router] if router is not None else [])
        _stop([proc for _, proc in servers])
    if exit_code:
        sys.exit(exit_code)


def _stop(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM each (a server stops its own processes), then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
