"""What a hostile request costs everyone else, on a real server (default model).

Measured in one run, each beside its own baseline:
- /health latency while 50 MB bodies (sized and chunked) are refused, against idle /health;
- the HTTP process's peak memory (VmHWM) before and after those refusals;
- a 2-token request's latency beside a maximal fan-out (one /generate batch of
  --max-request-sequences prompts, long outputs), against the same request alone; the fan-out
  is then abandoned (its client disconnects, which aborts it);
- the same with a /v1/completions fan-out (prompts x n);
- the same 2-token request while a JSON schema with a 20,000-value enum compiles (and then
  generates), against it alone (`--compile-only` runs just this, `--speculative-algorithm` on
  a speculative server, whose worker follows grammars too).

    python bench/hostile.py [--fan-out-tokens 256] [--dtype bfloat16]
    python bench/hostile.py --compile-only [--speculative-algorithm EAGLE3]

Prints a table of ratios and writes bench/out/hostile.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectral.args import ServerArgs  # noqa: E402
from tests.server_utils import peak_rss_kib, start_server, stop_server  # noqa: E402

BODY = b'{"text": "' + b"a" * (50 * 2**20) + b'"}'
SMALL = {"text": "Quick question:", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def health_times(url: str, seconds: float | None = None, while_alive=None) -> list[float]:
    out = []
    end = time.monotonic() + (seconds or 0)
    while (while_alive is not None and while_alive.is_alive()) or time.monotonic() < end:
        t = time.perf_counter()
        httpx.get(url + "/health", timeout=30)
        out.append(time.perf_counter() - t)
        time.sleep(0.01)
    return out


def refuse_huge_bodies(url: str, pid: int) -> dict:
    idle = health_times(url, seconds=2.0)
    peak_before = peak_rss_kib(pid)
    busy, statuses = [], []

    def chunks():
        for i in range(0, len(BODY), 2**20):
            yield BODY[i : i + 2**20]

    def send(content) -> None:
        statuses.append(httpx.post(url + "/generate", content=content, timeout=120).status_code)

    for content in (BODY, chunks(), BODY):
        sender = threading.Thread(target=send, args=(content,))
        sender.start()
        busy += health_times(url, while_alive=sender)
        sender.join()
    return {
        "statuses": statuses,
        "health_idle_ms_median": 1000 * statistics.median(idle),
        "health_busy_ms_median": 1000 * statistics.median(busy),
        "health_busy_ms_max": 1000 * max(busy),
        "health_busy_calls": len(busy),
        "http_peak_rss_mib_before": peak_before / 1024,
        "http_peak_rss_mib_after": peak_rss_kib(pid) / 1024,
    }


async def small_latency(http: httpx.AsyncClient) -> float:
    t = time.perf_counter()
    res = await http.post("/generate", json=SMALL)
    res.raise_for_status()
    return time.perf_counter() - t


async def beside_fan_out(url: str, path: str, body: dict, rows: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        alone = [await small_latency(http) for _ in range(3)]
        big = asyncio.create_task(http.post(path, json=body))
        t0 = time.perf_counter()
        while (await http.get("/get_server_info")).json()["requests"]["running"] < rows:
            await asyncio.sleep(0.05)
        filled = time.perf_counter() - t0
        beside = [await small_latency(http) for _ in range(3)]
        info = (await http.get("/get_server_info")).json()
        big_done = big.done()
        big.cancel()  # the client goes away: the fan-out is aborted
    return {
        "small_alone_s_median": statistics.median(alone),
        "small_beside_s_median": statistics.median(beside),
        "small_beside_s_max": max(beside),
        "fan_out_rows_filled_after_s": filled,
        "fan_out_finished_meanwhile": big_done,
        "waiting_when_measured": info["requests"]["waiting"],
    }


ENUM_VALUES = 20000


async def beside_a_compile(url: str) -> dict:
    """The small request's latency alone, then over and over while a request under a huge
    enum schema compiles and runs."""
    values = [f"value-{i}" for i in range(ENUM_VALUES)]
    schema = {"type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}
    body = {
        "text": "Pick one:",
        "sampling_params": {
            "max_new_tokens": 16,
            "temperature": 0,
            "json_schema": json.dumps(schema),
        },
    }
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        for _ in range(3):  # warm-up
            await small_latency(http)
        alone = [await small_latency(http) for _ in range(10)]
        t0 = time.perf_counter()
        huge = asyncio.create_task(http.post("/generate", json=body))
        beside = []
        while not huge.done():
            beside.append(await small_latency(http))
        res = await huge
        took = time.perf_counter() - t0
    return {
        "small_alone_s_median": statistics.median(alone),
        "small_beside_s_median": statistics.median(beside) if beside else None,
        "small_beside_s_max": max(beside) if beside else None,
        "small_beside_count": len(beside),
        "enum_status": res.status_code,
        "enum_took_s": took,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--fan-out-tokens", type=int, default=256)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--speculative-algorithm", default=None)
    ns = ap.parse_args()
    defaults = ServerArgs()
    spec = ["--speculative-algorithm", ns.speculative_algorithm] if ns.speculative_algorithm else []
    proc, url = start_server("--dtype", ns.dtype, *spec)
    try:
        results = {"compile": asyncio.run(beside_a_compile(url))}
        if ns.compile_only:
            return report(results, None)
        results["huge_bodies"] = refuse_huge_bodies(url, proc.pid)
        seqs, rows = defaults.max_request_sequences, defaults.max_running_requests
        params = {"max_new_tokens": ns.fan_out_tokens, "ignore_eos": True, "temperature": 0.7}
        results["generate_batch"] = asyncio.run(
            beside_fan_out(
                url,
                "/generate",
                {"text": [f"Story {i}:" for i in range(seqs)], "sampling_params": params},
                rows,
            )
        )
        time.sleep(2)
        n = 16
        results["completions_n"] = asyncio.run(
            beside_fan_out(
                url,
                "/v1/completions",
                {
                    "prompt": [f"Poem {i}:" for i in range(seqs // n)],
                    "n": n,
                    "max_tokens": ns.fan_out_tokens,
                    "ignore_eos": True,
                },
                rows,
            )
        )
    finally:
        stop_server(proc)
    report(results, seqs)


def report(results: dict, seqs: int | None) -> None:
    c = results["compile"]
    if c["small_beside_s_median"] is None:
        print(f"the enum request ended ({c['enum_status']}) before a small one could be timed")
    else:
        print(
            f"{ENUM_VALUES}-value enum schema: {c['enum_status']} after {c['enum_took_s']:.1f} s; "
            f"2-token request beside it {c['small_beside_s_median']:.3f} s median (max "
            f"{c['small_beside_s_max']:.3f}, {c['small_beside_count']} requests), "
            f"{c['small_alone_s_median']:.3f} s alone: "
            f"{c['small_beside_s_median'] / c['small_alone_s_median']:.2f}x"
        )
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "hostile.json").write_text(json.dumps(results, indent=2))
    if "huge_bodies" not in results:
        return
    h = results["huge_bodies"]
    print(f"50 MB bodies refused with {h['statuses']}")
    print(
        f"/health median {h['health_busy_ms_median']:.1f} ms (max {h['health_busy_ms_max']:.1f}, "
        f"{h['health_busy_calls']} calls) while refusing, {h['health_idle_ms_median']:.1f} ms "
        f"idle: {h['health_busy_ms_median'] / h['health_idle_ms_median']:.2f}x"
    )
    print(
        f"HTTP process peak RSS {h['http_peak_rss_mib_before']:.0f} -> "
        f"{h['http_peak_rss_mib_after']:.0f} MiB"
    )
    for name in ("generate_batch", "completions_n"):
        r = results[name]
        print(
            f"{name}: 2-token request {r['small_beside_s_median']:.2f} s beside a fan-out of "
            f"{seqs} sequences ({r['waiting_when_measured']} still queued), "
            f"{r['small_alone_s_median']:.2f} s alone: "
            f"{r['small_beside_s_median'] / r['small_alone_s_median']:.1f}x "
            f"(fan-out finished meanwhile: {r['fan_out_finished_meanwhile']})"
        )


if __name__ == "__main__":
    main()
