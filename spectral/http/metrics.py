"""Prometheus metrics: request counters and latency histograms observed by the tokenizer
manager, and scheduler gauges read when /metrics is scraped. Names follow SGLang's
(`spectral:` instead of `sglang:`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("spectral:num_requests", "Finished requests", registry=r)
        self.prompt_tokens = Counter("spectral:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "spectral:generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "spectral:time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "spectral:inter_token_latency_seconds",
            "Time between tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "spectral:e2e_request_latency_seconds",
            "Request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("spectral:num_running_reqs", "Requests running", registry=r)
        self.waiting = Gauge("spectral:num_queue_reqs", "Requests waiting", registry=r)
        self.token_usage = Gauge(
            "spectral:token_usage", "Share of KV slots in use by requests", registry=r
        )
        self.cache_hit_rate = Gauge(
            "spectral:cache_hit_rate",
            "Prompt tokens served by the radix cache / prompt tokens",
            registry=r,
        )
        self.spec_accept_length = Gauge(
            "spectral:spec_accept_length",
            "Tokens per speculative round and request, averaged since start (0 without one)",
            registry=r,
        )

        self.spec_tree_nodes = Gauge(
            "spectral:spec_tree_nodes",
            "Tree nodes verified per request and round (root included), averaged since start",
            registry=r,
        )
        self.spec_predicted_gain = Gauge(
            "spectral:spec_predicted_gain",
            "Speculative rounds' tokens/s over plain decoding's, as the tree planner predicted",
            registry=r,
        )
        self.spec_measured_gain = Gauge(
            "spectral:spec_measured_gain",
            "Speculative rounds' tokens/s over plain decoding's, as measured",
            registry=r,
        )

    def observe_tokens(self, new_tokens: int, since_last: float, first: bool) -> None:
        if first:
            self.ttft.observe(since_last)
            new_tokens -= 1
        for _ in range(max(new_tokens, 0)):
            self.itl.observe(since_last / max(new_tokens, 1))

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, latency: float) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(latency)

    def render(self, server_info: dict[str, Any]) -> bytes:
        """The exposition text, after refreshing the gauges from the scheduler's info."""
        requests, memory, stats = (
            server_info["requests"],
            server_info["memory"],
            server_info["stats"],
        )
        self.running.set(requests["running"])
        self.waiting.set(requests["waiting"])
        in_use = memory["total_tokens"] - memory["free_tokens"] - memory["evictable_tokens"]
        self.token_usage.set(in_use / max(memory["total_tokens"], 1))
        looked_up = stats["cached_tokens"] + stats["prefill_tokens"]
        self.cache_hit_rate.set(stats["cached_tokens"] / looked_up if looked_up else 0.0)
        self.spec_accept_length.set(stats.get("spec_accept_length", 0.0))
        rounds = server_info.get("speculative", {}).get("rounds", {})
        self.spec_tree_nodes.set(rounds.get("tree_nodes_per_request", 0.0))
        self.spec_predicted_gain.set(rounds.get("predicted_gain", 0.0))
        self.spec_measured_gain.set(rounds.get("measured_gain", 0.0))
        return generate_latest(self.registry)
