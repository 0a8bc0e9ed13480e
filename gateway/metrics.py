"""Prometheus metrics of one gateway, on its own registry.

HTTP requests by route and status, time to first token, time per output token,
end-to-end latency, requests in flight, client disconnects, and the scheduler's
figures (from EngineCore.GetStats) re-exported as gauges on every scrape.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.step_types import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)

# SchedulerStats field -> (metric name, help)
_SCHEDULER_GAUGES = {
    "num_running": ("tessera_scheduler_requests_running", "Requests in the running set"),
    "num_waiting": ("tessera_scheduler_requests_waiting", "Requests waiting, preempted included"),
    "kv_cache_usage": ("tessera_scheduler_kv_cache_usage", "Fraction of KV blocks in use"),
    "num_blocks_used": ("tessera_scheduler_kv_blocks_used", "KV blocks owned by requests"),
    "num_blocks_total": ("tessera_scheduler_kv_blocks_total", "KV blocks in the pool"),
    "prefix_cache_queries": ("tessera_scheduler_prefix_cache_queries", "Prompt tokens looked up"),
    "prefix_cache_hits": ("tessera_scheduler_prefix_cache_hits", "Prompt tokens found cached"),
    "num_preemptions": ("tessera_scheduler_preemptions", "Preemptions since start"),
    "num_steps": ("tessera_scheduler_steps", "Engine steps since start"),
    "num_finished": ("tessera_scheduler_requests_finished", "Requests finished since start"),
    "spec_decode_num_drafts": (
        "tessera_scheduler_spec_decode_num_drafts",
        "Request steps that verified draft tokens",
    ),
    "spec_decode_num_draft_tokens": (
        "tessera_scheduler_spec_decode_num_draft_tokens",
        "Draft tokens verified since start",
    ),
    "spec_decode_num_accepted_tokens": (
        "tessera_scheduler_spec_decode_num_accepted_tokens",
        "Draft tokens accepted since start",
    ),
}


class RequestTimer:
    """Times one engine request: first token, per output token, end to end."""

    def __init__(self, metrics: GatewayMetrics, arrival_time: float) -> None:
        self._metrics = metrics
        self._start = time.perf_counter() - max(0.0, time.time() - arrival_time)
        self._first: float | None = None
        self._num_tokens = 0

    def tokens(self, count: int) -> None:
        if count and self._first is None:
            self._first = time.perf_counter()
            self._metrics.ttft.observe(self._first - self._start)
        self._num_tokens += count

    def finish(self) -> None:
        now = time.perf_counter()
        self._metrics.e2e.observe(now - self._start)
        if self._first is not None and self._num_tokens > 1:
            self._metrics.tpot.observe((now - self._first) / (self._num_tokens - 1))


class GatewayMetrics:
    """Every metric the gateway exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "tessera_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "tessera_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tessera_time_per_output_token_seconds", "Time per output token after the first",
            buckets=_TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "tessera_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "tessera_requests_in_flight", "Generate requests in flight", registry=r
        )
        self.disconnects = Counter(
            "tessera_client_disconnects", "Clients that went away mid-request", registry=r
        )
        self.timeouts = Counter(
            "tessera_request_timeouts", "Requests aborted at their deadline", registry=r
        )
        self.scheduler_up = Gauge(
            "tessera_scheduler_up", "1 when the last GetStats call succeeded", registry=r
        )
        self.scheduler = {
            name: Gauge(metric, help_text, registry=r)
            for name, (metric, help_text) in _SCHEDULER_GAUGES.items()
        }

    def request_timer(self, arrival_time: float) -> RequestTimer:
        return RequestTimer(self, arrival_time)

    def set_scheduler_stats(self, stats: SchedulerStats | None) -> None:
        """Re-export the scheduler's figures (None: the scheduler did not answer)."""
        self.scheduler_up.set(0 if stats is None or not stats.healthy else 1)
        if stats is not None:
            for name, gauge in self.scheduler.items():
                gauge.set(float(getattr(stats, name)))

    def render(self) -> bytes:
        return generate_latest(self.registry)
