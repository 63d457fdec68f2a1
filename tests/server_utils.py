"""Start a real spectral server on a free loopback port, and find its processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from spectral.server.data_parallel import free_port  # noqa: F401 (tests import it here)


def launch_command(*flags: str) -> list[str]:
    """The command line that launches a server with `flags`."""
    return [sys.executable, "-m", "spectral.launch_server", *flags]


def start_server(
    *flags: str, timeout: float = 120.0, log: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """A server with `flags` on a free port, once it answers /health; its output to `log`
    where given."""
    port = free_port()
    out = open(log, "w") if log is not None else None  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        launch_command("--port", str(port), "--log-level", "warning", *flags),
        start_new_session=True,
        stdout=out,
        stderr=subprocess.STDOUT if out is not None else None,
    )
    if out is not None:
        out.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not come up")


def start_fp32_server(
    model_dir: str, api_key: str | None, *flags: str
) -> tuple[subprocess.Popen, str]:
    """The default model in float32 with a 16k-token pool, behind `api_key` if one is given."""
    key = ["--api-key", api_key] if api_key else []
    return start_server(
        "--model-path", model_dir, "--dtype", "float32", "--max-total-tokens", "16384", *key, *flags
    )


def run_bench_serving(
    url: str, model_dir: str, out: Path, api_key: str | None = None
) -> list[dict]:
    """SGLang's bench_serving (sglang backend, 8 random-id prompts of 32 tokens, 8 new tokens
    each, 4 at a time) against `url`, offline (it reads the model's config and tokenizer from
    `model_dir`; given a name, it would ask the hub); its JSON reports."""
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url]
    cmd += ["--dataset-name", "random-ids", "--tokenizer", model_dir, "--model", model_dir]
    cmd += ["--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8"]
    cmd += ["--random-range-ratio", "1.0", "--max-concurrency", "4", "--disable-tqdm"]
    run = subprocess.run(
        [*cmd, "--output-file", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            **({"OPENAI_API_KEY": api_key} if api_key else {}),
        },
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines() if line]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, and if the server is not gone in 30 s, kill its whole process group. Every
    process the server started must be gone within 10 s of its exit (AssertionError)."""
    children = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    survivors = [cmdline(p) for p in survivors_after(children)]
    assert not survivors, f"processes outlived the server's SIGTERM: {survivors}"


def survivors_after(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Those of `pids` still alive after waiting up to `timeout` s for all of them to go."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def server_processes(proc: subprocess.Popen) -> dict[int, str]:
    """The server's process and its children: pid -> command line."""
    return {pid: cmdline(pid) for pid in [proc.pid, *descendants(proc.pid)]}


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for process {pid}")


def wait_idle_and_accounted(server: str, headers: dict | None = None, timeout: float = 20.0):
    """Wait until the server is idle with every KV slot free or in the radix cache (none held
    by a request); return its server info."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(server + "/get_server_info", headers=headers, timeout=10).json()
        mem = info["memory"]
        idle = info["requests"] == {"running": 0, "waiting": 0}
        if (
            idle
            and mem["protected_tokens"] == 0
            and mem["free_tokens"] + mem["evictable_tokens"] == mem["total_tokens"]
        ):
            return info
        assert time.monotonic() < deadline, f"server did not return to idle: {info}"
        time.sleep(0.2)
