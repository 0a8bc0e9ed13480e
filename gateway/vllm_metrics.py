"""The `vllm:*` Prometheus series, named, typed, labelled and bucketed as vLLM V1 exports them
(vllm/v1/metrics/loggers.py), so dashboards, KEDA and the Inference Extension's endpoint
picker read Tessera as they read vLLM.

Every series carries `model_name` (the served model name) and `engine` (the engine replica's
index, "0" with one scheduler). Two sources feed them:
- the scheduler's figures (`SchedulerStats`, polled at each scrape): running / waiting / KV
  usage as gauges; preemptions, prefix-cache queries and hits, speculative-decoding counts as
  counters advanced by how much the scheduler's running totals grew (`RunningTotals`);
- each finished request, seen by the gateway (`FinishedRequest`): token counters, the
  request-success counter by finish reason and the latency and size histograms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from services.iteration_tokens import BUCKETS as ITERATION_TOKENS_BUCKETS
from services.step_types import SchedulerStats

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")  # str(vllm.v1.engine.FinishReason)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# SchedulerStats running total -> (vLLM counter name without _total, help)
SCHEDULER_COUNTERS = {
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "prefix_cache_queries": (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "prefix_cache_hits": (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens": (
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
    ),
    "spec_decode_num_accepted_tokens": (
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
    ),
}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class FinishedRequest:
    """What the gateway measured of one engine request once it ended (seconds, token counts)."""

    finish_reason: str  # one of FINISH_REASONS
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None  # the request's max_tokens parameter, when the client set one
    e2e: float  # arrival at the gateway -> last output
    queued: float  # entered the scheduler's queue -> first scheduled (scheduler's clock)
    prefill: float  # first scheduled -> first token (scheduler's clock)
    decode: float  # first output token -> last output token


class RunningTotals:
    """Turns a source's running totals into counter increments that never go back.

    A total below the one seen before means the source restarted: the new total is all new.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}

    def increment(self, source: str, name: str, total: float, restarted: bool) -> float:
        last = self._last.get((source, name), 0.0)
        self._last[(source, name)] = total
        return total if restarted or total < last else total - last

    def restarted(self, source: str, steps: float) -> bool:
        """Whether `source`'s step count went down (a restarted scheduler)."""
        return steps < self._last.get((source, "num_steps"), 0.0)


class IterationTokens(Collector):
    """vllm:iteration_tokens_total, the histogram of tokens per engine step, rebuilt from the
    schedulers' running bucket counts (a prometheus_client Histogram can only observe)."""

    def __init__(self, model_name: str, totals: RunningTotals) -> None:
        self.model_name = model_name
        self._totals = totals
        self._counts: dict[str, list[float]] = {}  # engine -> steps per bucket (+1 past the last)
        self._sums: dict[str, float] = {}

    def add_engine(self, engine: str) -> None:
        self._counts.setdefault(engine, [0.0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
        self._sums.setdefault(engine, 0.0)

    def advance(self, source: str, engine: str, stats: SchedulerStats, restarted: bool) -> None:
        """Add how much `source`'s bucket counts and sum grew since its previous figures."""
        self.add_engine(engine)
        counts = self._counts[engine]
        for i, total in enumerate(stats.iteration_tokens_bucket_counts[: len(counts)]):
            counts[i] += self._totals.increment(source, f"iteration_tokens_{i}", total, restarted)
        total_sum = float(stats.iteration_tokens_sum)
        self._sums[engine] += self._totals.increment(
            source, "iteration_tokens_sum", total_sum, restarted
        )

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            labels=list(LABELS),
        )  # fmt: skip
        bounds = [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
        for engine, counts in sorted(self._counts.items()):
            cumulative, running = [], 0.0
            for bound, count in zip(bounds, counts, strict=True):
                running += count
                cumulative.append((bound, running))
            family.add_metric([self.model_name, engine], cumulative, self._sums[engine])
        yield family


class VllmMetrics:
    """The vllm:* series of one served model, on `registry`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self._totals = RunningTotals()
        self._children: dict[tuple[int, str], Any] = {}
        labels = list(LABELS)
        r = registry
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            labels, registry=r,
        )  # fmt: skip
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            labels, registry=r,
        )  # fmt: skip
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            labels, registry=r,
        )  # fmt: skip
        self.scheduler_counters = {
            field: Counter(name, text, labels, registry=r)
            for field, (name, text) in SCHEDULER_COUNTERS.items()
        }
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*labels, "finished_reason"], registry=r,
        )  # fmt: skip
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = _histogram(
            r, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = _histogram(
            r, "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets,
        )  # fmt: skip
        self.request_max_tokens = _histogram(
            r, "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets,
        )  # fmt: skip
        self.ttft = _histogram(
            r, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = _histogram(
            r, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )  # fmt: skip
        self.request_tpot = _histogram(
            r, "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = _histogram(
            r, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue = _phase(r, "vllm:request_queue_time_seconds", "WAITING")
        self.inference = _phase(r, "vllm:request_inference_time_seconds", "RUNNING")
        self.prefill = _phase(r, "vllm:request_prefill_time_seconds", "PREFILL")
        self.decode = _phase(r, "vllm:request_decode_time_seconds", "DECODE")
        self.iteration_tokens = IterationTokens(model_name, self._totals)
        registry.register(self.iteration_tokens)
        self.add_engine("0")

    def _labels(self, engine: str) -> dict[str, str]:
        return {"model_name": self.model_name, "engine": engine}

    def add_engine(self, engine: str) -> None:
        """Create every series of `engine` at 0 (request success for every reason), as vLLM
        does, so dashboards see them before the first request."""
        for reason in FINISH_REASONS:
            self.request_success.labels(self.model_name, engine, reason)
        for metric in self._per_engine():
            metric.labels(self.model_name, engine)
        self.iteration_tokens.add_engine(engine)

    def _per_engine(self) -> list[Gauge | Counter | Histogram]:
        return [
            v
            for v in vars(self).values()
            if isinstance(v, Gauge | Counter | Histogram) and v is not self.request_success
        ] + list(self.scheduler_counters.values())

    # -- the scheduler's figures -------------------------------------------------------------

    def set_scheduler_stats(self, source: str, engine: str, stats: SchedulerStats) -> None:
        """Gauges from `stats`; counters advanced by how much `source`'s totals grew."""
        labels = self._labels(engine)
        self.running.labels(**labels).set(stats.num_running)
        self.waiting.labels(**labels).set(stats.num_waiting)
        self.kv_usage.labels(**labels).set(min(1.0, max(0.0, stats.kv_cache_usage)))
        restarted = self._totals.restarted(source, stats.num_steps)
        for field, counter in self.scheduler_counters.items():
            total = float(getattr(stats, field))
            counter.labels(**labels).inc(self._totals.increment(source, field, total, restarted))
        self.iteration_tokens.advance(source, engine, stats, restarted)
        self._totals.increment(source, "num_steps", float(stats.num_steps), restarted)

    def drop_engines(self, engines: Iterable[str]) -> None:
        """Remove the gauges of replicas no longer known (their counters stay)."""
        for engine in engines:
            for gauge in (self.running, self.waiting, self.kv_usage):
                with contextlib.suppress(KeyError):
                    gauge.remove(self.model_name, engine)

    # -- requests ---------------------------------------------------------------------------

    def _child(self, metric: Counter | Histogram, engine: str) -> Any:
        """`metric`'s series for `engine`, looked up once (labels() costs microseconds);
        only for request series, which are never removed."""
        key = (id(metric), engine)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.model_name, engine)
        return child

    def first_token(self, engine: str, ttft: float, num_prompt_tokens: int) -> None:
        """A request's first output token: TTFT, and its prompt counts as processed."""
        self._child(self.ttft, engine).observe(ttft)
        self._child(self.prompt_tokens, engine).inc(num_prompt_tokens)

    def tokens(self, engine: str, count: int, itl: float | None) -> None:
        """One output with `count` new tokens; `itl`: seconds since the previous output."""
        self._child(self.generation_tokens, engine).inc(count)
        if itl is not None:
            self._child(self.itl, engine).observe(itl)

    def finished(self, engine: str, req: FinishedRequest) -> None:
        child = self._child
        self.request_success.labels(self.model_name, engine, req.finish_reason).inc()
        child(self.e2e, engine).observe(req.e2e)
        child(self.queue, engine).observe(req.queued)
        child(self.prefill, engine).observe(req.prefill)
        child(self.decode, engine).observe(req.decode)
        child(self.inference, engine).observe(req.prefill + req.decode)
        child(self.request_prompt_tokens, engine).observe(req.num_prompt_tokens)
        child(self.request_generation_tokens, engine).observe(req.num_generation_tokens)
        tpot = req.decode / (req.num_generation_tokens - 1) if req.num_generation_tokens > 1 else 0
        child(self.request_tpot, engine).observe(tpot)
        if req.max_tokens:
            child(self.request_max_tokens, engine).observe(req.max_tokens)


def _histogram(
    registry: CollectorRegistry, name: str, text: str, buckets: Iterable[float]
) -> Histogram:
    return Histogram(name, text, list(LABELS), buckets=list(buckets), registry=registry)


def _phase(registry: CollectorRegistry, name: str, phase: str) -> Histogram:
    text = f"Histogram of time spent in {phase} phase for request."
    return _histogram(registry, name, text, REQUEST_LATENCY_BUCKETS)
