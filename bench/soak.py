"""Hours under load with faults: a server (or `--dp-size 2` behind sglang-router) under a mixed
open-loop load (bench/soak_load.py: chat and completions, streaming and not, n > 1, regex,
JSON-schema and EBNF requests with hostile ones among them, invalid fields, bodies over the
limit, clients that hang up mid-stream, aborts) for `--minutes`, with faults on a schedule:

- every 10 minutes from minute 3, the model worker stopped (SIGSTOP) for 5 s, then resumed
  (the scheduler process, which holds it, unless the server runs it in a process of its own);
- with `--dp-size 2`, at minute 6 (then every 10) one server SIGKILLed with its children and
  started again on its port, the router serving meanwhile from the other;
- at the end, the scheduler child SIGKILLed: the server must exit (every process gone) and say
  why.

Each minute ends with an idle gap: no new requests, in-flight ones answered, then the KV slots
held by requests are read (they must be 0), with every process's RSS and open descriptors.
Per minute it records requests by outcome (ok, 4xx by reason, 5xx, lost: accepted and never
answered), p50/p99 latency of the ok ones and time to first token of the streams; a summary
checks the issue's bounds (no lost request and no 5xx outside the faults' own, RSS growth from
minute 5 to the end <= 2%, p99 in the last 5 minutes within 1.2x of minutes 5-10, serving again
within 10 s of each fault). The servers' grammar cache is bounded at `--grammar-cache-mib`
(16; the server's default is 512), small enough to fill before minute 5 with the hostile
schemas, each new: growth after that is what keeping the cache at its bound costs. Writes
bench/out/soak-<name>.json and .png (name: plain, eagle3, ... with -dp2 for two servers) and
the server's output beside them (.log).

    python bench/soak.py [--minutes 30] [--rate 2] [--speculative-algorithm EAGLE3] [--dp-size 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import pyplot  # noqa: E402
from bench.soak_load import BODY_LIMIT, pick  # noqa: E402
from tests.server_utils import alive, cmdline, descendants, start_server, stop_server  # noqa: E402

OUT = Path(__file__).parent / "out"
IDLE_GAP_S = 6.0  # the end of each minute: no new requests
REQUEST_TIMEOUT_S = 120.0
STOP_S = 5.0  # a worker's SIGSTOP
RECOVERY_LIMIT_S = 10.0


def role(pid: int) -> str:
    line = cmdline(pid)
    for key, name in (
        ("spectral.server.worker_process", "worker"),  # modules: the flags name a worker_process
        ("spectral.server.scheduler_process", "scheduler"),
        ("spectral.server.detokenizer", "detokenizer"),
        ("sglang_router", "router"),
        ("launch_server", "http"),
    ):
        if key in line:
            return name
    return "other"


def processes(root: int) -> dict[int, str]:
    """The server's processes (the launcher's tree), pid -> role (numbered where repeated)."""
    out: dict[int, str] = {}
    seen: Counter = Counter()
    for pid in [root, *descendants(root)]:
        name = role(pid)
        seen[name] += 1
        out[pid] = name if seen[name] == 1 else f"{name}{seen[name]}"
    return out


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


async def probe(http: httpx.AsyncClient) -> bool:
    try:
        res = await http.post(
            "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        )
        return res.status_code == 200
    except (httpx.TransportError, httpx.TimeoutException):
        return False


async def serving_again(http: httpx.AsyncClient, limit: float = 60.0) -> float | None:
    """Seconds until a small request is served (None past `limit`)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if await probe(http):
            return time.monotonic() - start
        await asyncio.sleep(0.2)
    return None


async def held_when_idle(
    http: httpx.AsyncClient, urls: list[str]
) -> tuple[int | None, int, int, dict]:
    """KV tokens held by requests once every server is idle (each server read directly; None
    where one did not answer or stayed busy), the bytes of their compiled-grammar caches, the
    tokens in their n-gram indexes (bounded caches, which fill as new grammars and requests
    come), and the first server's last /get_server_info ({} where it did not answer)."""
    held, cached, indexed, first = 0, 0, 0, {}
    for url in urls:
        for _ in range(50):
            try:
                info = (await http.get(url + "/get_server_info")).json()
            except (httpx.TransportError, httpx.TimeoutException, ValueError):
                return None, cached, indexed, first
            if url == urls[0]:
                first = info
            mem = info["memory"]
            if info["requests"] == {"running": 0, "waiting": 0}:
                held += mem["total_tokens"] - mem["free_tokens"] - mem["evictable_tokens"]
                cached += info["caches"]["grammars"]["bytes"]
                indexed += info["caches"].get("ngram_index", {}).get("tokens", 0)
                break
            await asyncio.sleep(0.2)
        else:
            return None, cached, indexed, first
    return held, cached, indexed, first


def server_counters(info: dict) -> dict:
    """The server's step statistics and its planner's record (rounds by kind, their acceptance
    and calibration) at the end of a minute, from its /get_server_info: what a drift in latency
    came from."""
    return {"stats": info.get("stats"), "speculative": info.get("speculative")} if info else {}


class Soak:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.flags = ["--max-request-bytes", str(BODY_LIMIT), "--dtype", ns.dtype]
        self.flags += ["--grammar-cache-mib", str(ns.grammar_cache_mib)]
        if ns.speculative_algorithm:
            self.flags += ["--speculative-algorithm", ns.speculative_algorithm]
        if ns.dp_size > 1:
            self.flags += ["--dp-size", str(ns.dp_size)]
        self.name = (ns.speculative_algorithm or "plain").lower() + (
            f"-dp{ns.dp_size}" if ns.dp_size > 1 else ""
        )
        OUT.mkdir(exist_ok=True)
        # The server's own output (its warnings and any traceback) beside the figures.
        self.log = OUT / f"soak-{self.name}.log"
        self.proc, self.url = start_server(*self.flags, timeout=600, log=self.log)
        self.urls = self.server_urls()  # fixed: a restarted server takes its port again
        self.restarted: list = []
        self.minutes: list[dict] = []
        self.faults: list[dict] = []
        self.faulting = False  # requests sent meanwhile are the fault's own

    def server_urls(self) -> list[str]:
        """The servers behind the router (their --port flags), or the one server."""
        if self.ns.dp_size == 1:
            return [self.url]
        urls = []
        for pid, name in processes(self.proc.pid).items():
            words = cmdline(pid).split()
            if name.startswith("http") and pid != self.proc.pid and "--port" in words:
                urls.append(f"http://127.0.0.1:{words[words.index('--port') + 1]}")
        return sorted(urls)

    async def one(self, http: httpx.AsyncClient, outcomes: list, faulty: bool) -> None:
        name, send = pick()
        outcome, latency, ttft = await send(http)
        outcomes.append(
            {"kind": name, "outcome": outcome, "latency": latency, "ttft": ttft, "fault": faulty}
        )

    async def minute(self, http: httpx.AsyncClient, index: int) -> dict:
        outcomes: list[dict] = []
        tasks = []
        fault = asyncio.create_task(self.fault_at(http, index))
        end = time.monotonic() + 60.0 - IDLE_GAP_S
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(self.one(http, outcomes, self.faulting)))
            await asyncio.sleep(random.expovariate(self.ns.rate))
        await asyncio.gather(*tasks)
        await fault
        held, cached, indexed, info = await held_when_idle(http, self.urls)
        row = self.record(index, outcomes, held)
        row |= {"grammar_cache_mib": cached / 2**20, "ngram_index_tokens": indexed}
        return row | server_counters(info)

    async def fault_at(self, http: httpx.AsyncClient, index: int) -> None:
        if index % 10 == 3:
            await self.stop_worker(http, index)
        if self.ns.dp_size > 1 and index % 10 == 6:
            await self.kill_a_server(http, index)

    async def stop_worker(self, http: httpx.AsyncClient, index: int) -> None:
        tree = processes(self.proc.pid)
        holder = "worker" if "worker" in tree.values() else "scheduler"  # which runs the model
        worker = next(pid for pid, name in tree.items() if name == holder)
        await asyncio.sleep(10)
        self.faulting = True
        os.kill(worker, signal.SIGSTOP)
        await asyncio.sleep(STOP_S)
        os.kill(worker, signal.SIGCONT)
        again = await serving_again(http)
        self.faulting = False
        self.faults.append(
            {"minute": index, "fault": f"worker SIGSTOP {STOP_S:g} s", "serving_again_s": again}
        )

    async def kill_a_server(self, http: httpx.AsyncClient, index: int) -> None:
        await asyncio.sleep(10)
        victim = self.urls[0]
        port = victim.rsplit(":", 1)[1]
        tree = processes(self.proc.pid)
        for proc in self.restarted:
            tree |= processes(proc.pid)
        root = next(
            p for p, n in tree.items() if n.startswith("http") and f"--port {port}" in cmdline(p)
        )
        line = cmdline(root).split()
        self.faulting = True
        for pid in [root, *descendants(root)]:
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        again = await serving_again(http)
        restarted = await asyncio.to_thread(self.restart, line)
        self.faulting = False
        self.faults.append(
            {
                "minute": index,
                "fault": f"server {victim} SIGKILLed",
                "serving_again_s": again,
                "restarted_after_s": time.monotonic() - start if restarted else None,
            }
        )

    def restart(self, line: list[str]) -> bool:
        """The killed server's command again, on its port, until it answers /health."""
        with open(self.log.with_suffix(".restarted.log"), "a") as out:
            proc = subprocess.Popen(
                line, start_new_session=True, stdout=out, stderr=subprocess.STDOUT
            )
        self.restarted.append(proc)
        url = f"http://127.0.0.1:{line[line.index('--port') + 1]}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        return False

    def record(self, index: int, outcomes: list[dict], held: int | None) -> dict:
        ok = [o["latency"] for o in outcomes if o["outcome"] == "ok" and o["latency"] is not None]
        ttft = [o["ttft"] for o in outcomes if o["ttft"] is not None and o["outcome"] == "ok"]
        tree = processes(self.proc.pid)
        for proc in self.restarted:
            tree |= {pid: f"restarted-{name}" for pid, name in processes(proc.pid).items()}
        row = {
            "minute": index,
            "outcomes": dict(Counter(o["outcome"] for o in outcomes)),
            "fault_outcomes": dict(Counter(o["outcome"] for o in outcomes if o["fault"])),
            "latencies": ok,
            "p50_s": statistics.median(ok) if ok else None,
            "p99_s": quantile(ok, 0.99),
            "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "ttft_p99_s": quantile(ttft, 0.99),
            "kv_held_when_idle": held,
            "rss_mib": {name: rss_mib(pid) for pid, name in tree.items()},
            "open_fds": {name: open_fds(pid) for pid, name in tree.items()},
        }
        print(
            json.dumps(
                {k: row[k] for k in ("minute", "outcomes", "p50_s", "p99_s", "kv_held_when_idle")}
            ),
            flush=True,
        )
        return row

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(
            base_url=self.url, timeout=REQUEST_TIMEOUT_S, limits=limits
        ) as http:
            for index in range(self.ns.minutes):
                self.minutes.append(await self.minute(http, index))
                self.save()

    def kill_the_scheduler(self) -> dict:
        """The last fault: the scheduler SIGKILLed; the server must exit, every process gone."""
        tree = processes(self.proc.pid)
        scheduler = next(pid for pid, name in tree.items() if name == "scheduler")
        os.kill(scheduler, signal.SIGKILL)
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=30)
        except Exception:
            code = None
        gone = time.monotonic() - start
        left = [pid for pid in tree if alive(pid)]
        return {
            "fault": "scheduler SIGKILL",
            "server_exit_code": code,
            "exited_after_s": gone,
            "processes_left": left,
        }

    def save(self) -> None:
        OUT.mkdir(exist_ok=True)
        doc = {
            "flags": self.flags,
            "rate": self.ns.rate,
            "minutes": self.minutes,
            "faults": self.faults,
        }
        (OUT / f"soak-{self.name}.json").write_text(json.dumps(doc, indent=2))


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(minutes: list[dict], faults: list[dict]) -> dict:
    """The issue's bounds over the run."""

    def count(prefixes: tuple[str, ...]) -> int:
        return sum(
            n - m.get("fault_outcomes", {}).get(o, 0)
            for m in minutes
            for o, n in m["outcomes"].items()
            if o.startswith(prefixes)
        )

    def p99(rows: list[dict]) -> float | None:
        return quantile([x for m in rows for x in m["latencies"]], 0.99)

    growth, net = {}, {}
    if len(minutes) > 6:
        first, last = minutes[5]["rss_mib"], minutes[-1]["rss_mib"]
        growth = {n: last[n] / first[n] - 1 for n in first if first[n] and last.get(n)}
        # the scheduler's less what its grammar cache (bounded, reported) took meanwhile
        filled = minutes[-1]["grammar_cache_mib"] - minutes[5]["grammar_cache_mib"]
        if growth.get("scheduler") is not None:
            net["scheduler"] = (last["scheduler"] - filled) / first["scheduler"] - 1
    early, late = p99(minutes[5:10]), p99(minutes[-5:])
    return {
        "lost": count(("lost",)),
        "5xx": count(("5xx",)),
        "rss_growth_from_minute_5": growth,
        "scheduler_growth_net_of_its_grammar_cache": net,
        "kv_held_when_idle_max": max((m["kv_held_when_idle"] or 0) for m in minutes)
        if minutes
        else None,
        "kv_held_unknown_minutes": [m["minute"] for m in minutes if m["kv_held_when_idle"] is None],
        "p99_last_5_over_minutes_5_10": late / early if early and late else None,
        "slowest_recovery_s": max((f["serving_again_s"] or float("inf")) for f in faults)
        if faults
        else None,
    }


def plot(minutes: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None or not minutes:
        return
    x = [m["minute"] for m in minutes]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    kinds = {"ok": "ok", "4xx": "4xx", "5xx": "5xx", "lost": "lost", "disconnect": "hung up"}
    for prefix, label in kinds.items():
        axes[0][0].plot(
            x,
            [sum(n for o, n in m["outcomes"].items() if o.startswith(prefix)) for m in minutes],
            label=label,
        )
    axes[0][0].set_title("requests a minute by outcome")
    for key in ("p50_s", "p99_s", "ttft_p99_s"):
        axes[0][1].plot(x, [m[key] for m in minutes], label=key)
    axes[0][1].set_title("latency (s)")
    for name in minutes[-1]["rss_mib"]:
        axes[1][0].plot(x, [m["rss_mib"].get(name) for m in minutes], label=name)
    axes[1][0].set_title("RSS (MiB)")
    axes[1][0].set_yscale("log")
    axes[1][1].plot(x, [m["kv_held_when_idle"] for m in minutes], label="KV tokens held when idle")
    for name in minutes[-1]["open_fds"]:
        axes[1][1].plot(x, [m["open_fds"].get(name) for m in minutes], ":", label=f"fds {name}")
    axes[1][1].set_title("KV held when idle; open descriptors")
    for ax in axes.flat:
        ax.set_xlabel("minute")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=int, default=30)
    ap.add_argument("--rate", type=float, default=2.0, help="requests a second (Poisson)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--speculative-algorithm", default=None)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--grammar-cache-mib",
        type=int,
        default=16,
        help="the servers' bound (the hostile schemas are new each time, so the cache fills to "
        "it within the first minutes: from there RSS shows what evicting costs)",
    )
    ns = ap.parse_args()
    random.seed(ns.seed)
    soak = Soak(ns)
    try:
        asyncio.run(soak.run())
        end = soak.kill_the_scheduler() if ns.dp_size == 1 else None
    finally:
        for proc in [soak.proc, *soak.restarted]:
            if proc.poll() is None:
                stop_server(proc)
    result = summary(soak.minutes, soak.faults)
    path = OUT / f"soak-{soak.name}.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(doc | {"summary": result, "last_fault": end}, indent=2))
    plot(soak.minutes, path.with_suffix(".png"))
    print(json.dumps({"summary": result, "faults": soak.faults, "last_fault": end}, indent=2))


if __name__ == "__main__":
    main()
