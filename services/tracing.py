"""OpenTelemetry tracing and the log format: vLLM's `--otlp-traces-endpoint` and
`--collect-detailed-traces`, and `--log-format`, shared by every service.

Tracing is off by default and then costs nothing: no OpenTelemetry import, `tracer()` is
None and every hook is one `is None` test per request or per step, never per token. With
an endpoint each process exports its spans over OTLP/gRPC with the resource attribute
`service.name` (tessera-gateway, tessera-scheduler, tessera-worker). One request is one
trace: the gateway's `llm_request` span (parent: the client's `traceparent`, when sent)
is the root; its W3C context rides to the scheduler in `EngineCoreRequest.trace_headers`
and, for the steps a traced request is sampled in, to the worker in
`SchedulerOutput.trace_contexts`. The OpenTelemetry packages are an optional extra
(`pip install 'tessera[tracing]'`); asking for tracing without them is a clear error.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from services.flags import add_flags, flag, from_args

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context (vLLM's TRACE_HEADERS)
DETAILED_TRACE_MODULES = ("model", "worker", "all")  # vLLM's --collect-detailed-traces
LOG_FORMATS = ("text", "json")
SERVICE_NAMES = {
    "gateway": "tessera-gateway",
    "scheduler": "tessera-scheduler",
    "worker": "tessera-worker",
}
MISSING_PACKAGES = (
    "--otlp-traces-endpoint needs the OpenTelemetry packages (opentelemetry-sdk and "
    "opentelemetry-exporter-otlp-proto-grpc): pip install 'tessera[tracing]'"
)


class SpanAttributes:
    """vLLM's span attribute names (vllm/tracing.py), plus Tessera's own under tessera.*."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    FINISH_REASON = "tessera.finish_reason"
    NUM_CACHED_TOKENS = "tessera.num_cached_tokens"
    STEP_ID = "tessera.step_id"
    STEP_NUM_REQUESTS = "tessera.step.num_requests"
    STEP_NUM_TOKENS = "tessera.step.num_tokens"


def _modules(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


@dataclass(frozen=True)
class ObservabilityConfig:
    """Tracing and log format of one service (vLLM's ObservabilityConfig names)."""

    otlp_traces_endpoint: str = flag(
        "",
        "Export OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://127.0.0.1:4317; "
        "empty: tracing off.",
        metavar="URL",
    )
    collect_detailed_traces: tuple[str, ...] = flag(
        (),
        "Comma-separated model, worker or all (vLLM's modules): a worker span for every step of "
        "a traced request; empty: only for the step that starts each one.",
        metavar="MODULES",
        parse=_modules,
        show=",".join,
    )
    log_format: str = flag(
        "text",
        "text: `time level service [request id] logger: message`; json: one object a line.",
        choices=LOG_FORMATS,
    )

    def __post_init__(self) -> None:
        unknown = [m for m in self.collect_detailed_traces if m not in DETAILED_TRACE_MODULES]
        if unknown:
            raise ValueError(
                f"collect_detailed_traces: {unknown} not in {', '.join(DETAILED_TRACE_MODULES)}"
            )
        if self.collect_detailed_traces and not self.otlp_traces_endpoint:
            raise ValueError("collect_detailed_traces needs otlp_traces_endpoint")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be text or json, not {self.log_format!r}")

    @property
    def every_step(self) -> bool:
        """Whether every step of a traced request gets a worker span."""
        return bool(self.collect_detailed_traces)


def add_observability_args(p: argparse.ArgumentParser) -> None:
    """--otlp-traces-endpoint, --collect-detailed-traces (vLLM's names) and --log-format;
    every service takes them."""
    add_flags(p, ObservabilityConfig)


def observability_from_args(args: argparse.Namespace) -> ObservabilityConfig:
    """The observability flags of `args` (ValueError on bad values)."""
    return from_args(ObservabilityConfig, args)


def require_packages() -> None:
    """ValueError unless the OpenTelemetry SDK and its OTLP/gRPC exporter can be imported."""
    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError(f"{MISSING_PACKAGES} (no module {module})")


# ---- the process's tracer -----------------------------------------------------------

_tracer: Any = None  # opentelemetry.trace.Tracer once init_tracing ran with an endpoint
_provider: Any = None


def init_tracing(service: str, config: ObservabilityConfig) -> bool:
    """Export this process's spans to `config.otlp_traces_endpoint` as `service` (a key of
    SERVICE_NAMES); no-op without an endpoint. RuntimeError when the packages are missing.
    Returns whether tracing is on."""
    global _tracer, _provider
    if not config.otlp_traces_endpoint:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ValueError(f"{MISSING_PACKAGES} ({exc})") from None
    resource = Resource.create({"service.name": SERVICE_NAMES.get(service, service)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_traces_endpoint))
    )
    _provider, _tracer = provider, provider.get_tracer("tessera")
    return True


def tracer() -> Any:
    """The process's Tracer; None while tracing is off."""
    return _tracer


def shutdown_tracing() -> None:
    """Export what is buffered and stop (tests; a service exits through atexit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


# ---- W3C context --------------------------------------------------------------------


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace headers among `headers` (keys in lower case)."""
    return {h: headers[h] for h in TRACE_HEADERS if headers.get(h)}


def extract_context(headers: Mapping[str, str]) -> Any:
    """The OpenTelemetry Context the W3C `headers` carry (an empty one when they carry none
    or an invalid one: the span then starts a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(headers))


def inject_headers(span: Any) -> dict[str, str]:
    """The W3C headers (traceparent, tracestate) that make `span` the parent elsewhere."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def span_context(span: Any) -> Any:
    """A Context whose current span is `span` (the parent of spans started in it)."""
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def trace_id_hex(span: Any) -> str:
    """The 32-hex-digit trace id of `span` (what logs carry)."""
    return f"{span.get_span_context().trace_id:032x}"


def ns(unix_s: float) -> int:
    """Unix seconds as OpenTelemetry's nanoseconds."""
    return int(unix_s * 1e9)


@contextmanager
def _linked_span(
    name: str, traceparents: Sequence[str], attributes: dict[str, Any]
) -> Iterator[Any]:
    from opentelemetry import trace

    contexts = [extract_context({"traceparent": t}) for t in traceparents]
    links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in contexts[1:]]
    with _tracer.start_as_current_span(
        name, context=contexts[0], links=links, attributes=attributes
    ) as span:
        yield span


def step_span(traceparents: Sequence[str], attributes: dict[str, Any]) -> Any:
    """A context manager around one sampled worker step: the span `execute_model` in the
    first traceparent's trace (a step belongs to no single request; the first request the
    scheduler sampled it for hosts it), linked to the others. A null context while off."""
    if _tracer is None or not traceparents:
        return nullcontext(None)
    return _linked_span("execute_model", traceparents, attributes)


def step_attributes(step: Any) -> dict[str, Any]:
    """The attributes of a step's span, from its SchedulerOutput message."""
    return {
        SpanAttributes.STEP_ID: step.step_id,
        SpanAttributes.STEP_NUM_REQUESTS: len(step.num_scheduled_tokens),
        SpanAttributes.STEP_NUM_TOKENS: step.total_num_scheduled_tokens,
    }


def record_timings(span: Any, reply: Any) -> None:
    """Put a step's ModelRunnerOutput timings on its span (vLLM's model forward / execute
    latencies, in seconds); no-op on the null span."""
    if span is None:
        return
    timings = reply.timings
    span.set_attribute(
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD, timings.forward_ms / 1e3
    )
    span.set_attribute(SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE, timings.total_ms / 1e3)
    if reply.error:
        span.set_attribute("error", True)
