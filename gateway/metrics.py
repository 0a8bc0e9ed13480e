"""Prometheus metrics of one gateway, on its own registry.

Tessera's own series (tessera_*): HTTP requests by route and status, time to first
token, time per output token, end-to-end latency, requests in flight, client
disconnects, deadline timeouts, and the scheduler's figures (from EngineCore.GetStats,
summed over replicas) as gauges on every scrape. Beside them, once the served model is
known, the vllm:* series vLLM exports (gateway/vllm_metrics.py), per engine replica.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.router import aggregate_stats
from gateway.vllm_metrics import FinishedRequest, VllmMetrics
from services.step_types import SchedulerStats
from services.types import EngineCoreOutput, EngineCoreRequest, RequestTimestamps

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


class RequestTracker:
    """Times one engine request and counts its tokens, for the tessera_* and vllm:* series.

    Feed it every output (`on_output`), then `finish` it once with the finish reason
    ("stop", "length", "abort", "error"); later calls to `finish` do nothing.
    """

    def __init__(self, metrics: GatewayMetrics, request: EngineCoreRequest) -> None:
        self._metrics = metrics
        self._start = time.perf_counter() - max(0.0, time.time() - request.arrival_time)
        self._num_prompt_tokens = len(request.prompt_token_ids)
        self._max_tokens = request.sampling_params.max_tokens
        self._first: float | None = None  # perf_counter of the first and last output tokens
        self._last = 0.0
        self._num_tokens = 0
        self._timestamps = RequestTimestamps()
        self._engine = "0"
        self._done = False

    def on_output(self, out: EngineCoreOutput, replica: str = "") -> None:
        """One update of the request, from engine replica `replica` (its address)."""
        now = time.perf_counter()
        vllm = self._metrics.vllm
        if self._first is None:
            self._engine = self._metrics.engine_label(replica)
        if out.timestamps.queued:
            self._timestamps = out.timestamps
        count = len(out.new_token_ids)
        if not count:
            return
        itl: float | None = None
        if self._first is None:
            self._first = now
            self._metrics.ttft.observe(now - self._start)
            if vllm is not None:
                vllm.first_token(self._engine, now - self._start, self._num_prompt_tokens)
        else:
            itl = now - self._last
        self._last = now
        self._num_tokens += count
        if vllm is not None:
            vllm.tokens(self._engine, count, itl)

    def finish(self, reason: str | None) -> None:
        """The request ended with `reason`; None: it never ran (refused, no engine reachable),
        so nothing is recorded. Only the first call counts."""
        if self._done:
            return
        self._done = True
        if reason is None:
            return
        now = time.perf_counter()
        self._metrics.e2e.observe(now - self._start)
        if self._first is not None and self._num_tokens > 1:
            self._metrics.tpot.observe((now - self._first) / (self._num_tokens - 1))
        if self._metrics.vllm is not None:
            self._metrics.vllm.finished(self._engine, self._summary(reason, now))

    def _summary(self, reason: str, now: float) -> FinishedRequest:
        ts = self._timestamps
        return FinishedRequest(
            finish_reason=reason,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_tokens,
            max_tokens=self._max_tokens,
            e2e=now - self._start,
            queued=_span(ts.queued, ts.scheduled),
            prefill=_span(ts.scheduled, ts.first_token),
            decode=self._last - self._first if self._first is not None else 0.0,
        )


def _sum(stats: list[SchedulerStats]) -> SchedulerStats | None:
    """Several replicas' figures as one (None for none)."""
    if len(stats) <= 1:
        return stats[0] if stats else None
    return aggregate_stats(stats)


def _span(start: float, end: float) -> float:
    """end - start for two milestones (0 while either is unset)."""
    return max(0.0, end - start) if start and end else 0.0


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
        self.vllm: VllmMetrics | None = None  # once the served model is known
        self._engines: dict[str, str] = {}  # replica address -> engine label

    def bind_model(self, model_name: str, max_model_len: int) -> None:
        """Create the vllm:* series for the served model (once; later calls do nothing)."""
        if self.vllm is None:
            self.vllm = VllmMetrics(self.registry, model_name, max_model_len)
            for label in self._engines.values():
                self.vllm.add_engine(label)

    def engine_label(self, address: str) -> str:
        """The `engine` label of a replica: its index in order of first sight, never reused."""
        label = self._engines.get(address)
        if label is None:
            label = self._engines[address] = str(len(self._engines))
            if self.vllm is not None:
                self.vllm.add_engine(label)
        return label

    def track_request(self, request: EngineCoreRequest) -> RequestTracker:
        return RequestTracker(self, request)

    def set_replica_stats(self, replicas: Sequence[tuple[str, SchedulerStats | None]]) -> None:
        """Re-export every replica's figures ((address, None): it did not answer): the
        tessera_scheduler_* gauges summed over replicas, the vllm:* series per replica."""
        answered = [(a, s) for a, s in replicas if s is not None]
        total = _sum([s for _, s in answered])
        self.scheduler_up.set(0 if total is None or not total.healthy else 1)
        if total is not None:
            for name, gauge in self.scheduler.items():
                gauge.set(float(getattr(total, name)))
        if self.vllm is None:
            return
        for address, stats in answered:
            self.vllm.set_scheduler_stats(address, self.engine_label(address), stats)
        known = {self.engine_label(a) for a, _ in replicas}
        self.vllm.drop_engines(set(self._engines.values()) - known)

    def render(self) -> bytes:
        return generate_latest(self.registry)
