"""Prometheus metrics of one server, in a private registry (two servers in one process, as in
tests, must not collide in the global one). Names follow vLLM's, under `v1engine:`.

Latencies are measured in the API server, per engine request (an n > 1 request counts n times):
time to first token from arrival, inter-token latency between successive outputs of a request
(one per step while decoding). Running, waiting and KV cache usage come from the scheduler
stats the engine core sends with each step's outputs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from v1engine.request import SchedulerStats

# Finished requests are counted by outcome: "stop" (EOS, stop token or string), "length"
# (max_tokens or the context), "abort" (the client went away or the server shut down) or
# "error" (the engine died while the request ran).
OUTCOMES = ("stop", "length", "abort", "error")

_LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "v1engine:requests", "Finished requests by outcome.", ["outcome"], registry=registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every series exists from the start, at zero
        self.prompt_tokens = Counter(
            "v1engine:prompt_tokens", "Prompt tokens of accepted requests.", registry=registry
        )
        self.generation_tokens = Counter(
            "v1engine:generation_tokens", "Generated tokens.", registry=registry
        )
        self.time_to_first_token = Histogram(
            "v1engine:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "v1engine:inter_token_latency_seconds",
            "Seconds between successive generated tokens of a request.",
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.num_requests_running = Gauge(
            "v1engine:num_requests_running", "Requests in the running batch.", registry=registry
        )
        self.num_requests_waiting = Gauge(
            "v1engine:num_requests_waiting", "Requests waiting to be scheduled.", registry=registry
        )
        self.kv_cache_usage = Gauge(
            "v1engine:kv_cache_usage_perc",
            "Fraction of the KV cache blocks held by requests (0 to 1).",
            registry=registry,
        )

    def update_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)

    def observe_finished(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
