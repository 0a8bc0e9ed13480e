"""The gateway's spans (services.tracing): one `llm_request` root per generate request.

The root is opened when a request arrives (REST: `TracingMiddleware` on the generate
routes; gRPC: `request_trace` around a TextGeneration call) as a child of the client's
W3C `traceparent` / `tracestate` (HTTP headers or gRPC metadata), with `parse` and
`tokenize` children (`span`); a GenerateJob picks it up (`current_trace`) and its engine
requests carry its context to the scheduler. vLLM's attributes are set on the root:
request parameters when the job starts, usage and latencies when it ends. None of this is
built while tracing is off; per token, a traced request costs one counter update.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services import tracing
from services.log import trace_id_var
from services.tracing import SpanAttributes as A
from services.types import EngineCoreOutput

if TYPE_CHECKING:
    from gateway.serving import GenerateJob

TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "request_trace", default=None
)


class RequestTrace:
    """The root span of one client request and the figures its attributes need."""

    def __init__(self, tracer: Any, headers: Mapping[str, str]) -> None:
        from opentelemetry.trace import SpanKind

        self.tracer = tracer
        self.start = time.time()
        self.span = tracer.start_span(
            "llm_request",
            context=tracing.extract_context(tracing.trace_headers(headers)),
            kind=SpanKind.SERVER,
            start_time=tracing.ns(self.start),
        )
        self.context = tracing.span_context(self.span)
        self.headers = tracing.inject_headers(self.span)  # what engine requests carry
        self.trace_id = tracing.trace_id_hex(self.span)
        self.first_token = 0.0
        self.prompt_tokens = self.completion_tokens = 0
        self.queue_time: float | None = None
        self.status_code = 0  # the HTTP status (REST)

    def describe(self, job: GenerateJob, model: str) -> None:
        """The request's parameters (vLLM's gen_ai.request.* and response model)."""
        o = job.options
        attributes: dict[str, Any] = {
            A.GEN_AI_REQUEST_ID: job.request_id,
            A.GEN_AI_RESPONSE_MODEL: model,
            A.GEN_AI_REQUEST_TEMPERATURE: o.temperature,
            A.GEN_AI_REQUEST_TOP_P: o.top_p,
            A.GEN_AI_REQUEST_N: o.n,
        }
        if o.max_tokens is not None:
            attributes[A.GEN_AI_REQUEST_MAX_TOKENS] = o.max_tokens
        self.span.set_attributes(attributes)

    def describe_embedding(self, request_id: str, model: str, prompt_tokens: int) -> None:
        """An embedding request: its id, model and input tokens (no generation)."""
        self.prompt_tokens = prompt_tokens
        self.span.set_attributes({A.GEN_AI_REQUEST_ID: request_id, A.GEN_AI_RESPONSE_MODEL: model})

    def count(self, stream: AsyncIterable[EngineCoreOutput]) -> AsyncIterator[EngineCoreOutput]:
        """`stream`, noting the first token's time and the tokens generated."""
        return _Counted(self, stream.__aiter__())

    def on_output(self, out: EngineCoreOutput) -> None:
        if out.new_token_ids:
            self.completion_tokens += len(out.new_token_ids)
            if not self.first_token:
                self.first_token = time.time()

    def finish_choice(self, num_prompt_tokens: int, out: EngineCoreOutput) -> None:
        """One engine request ended with `out`."""
        self.prompt_tokens += num_prompt_tokens
        ts = out.timestamps
        if self.queue_time is None and ts.scheduled and ts.queued:
            self.queue_time = ts.scheduled - ts.queued

    @contextmanager
    def child(self, name: str) -> Iterator[Any]:
        span = self.tracer.start_span(name, context=self.context)
        try:
            yield span
        finally:
            span.end()

    def end(self, error: BaseException | None = None) -> None:
        now = time.time()
        attributes: dict[str, Any] = {
            A.GEN_AI_USAGE_PROMPT_TOKENS: self.prompt_tokens,
            A.GEN_AI_USAGE_COMPLETION_TOKENS: self.completion_tokens,
            A.GEN_AI_LATENCY_E2E: now - self.start,
        }
        if self.first_token:
            attributes[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = self.first_token - self.start
        if self.queue_time is not None:
            attributes[A.GEN_AI_LATENCY_TIME_IN_QUEUE] = self.queue_time
        if self.status_code:
            attributes["http.response.status_code"] = self.status_code
        self.span.set_attributes(attributes)
        if error is not None or self.status_code >= 500:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, repr(error) if error else None))
        self.span.end(end_time=tracing.ns(now))


class _Counted:
    """An engine stream seen by its RequestTrace (a plain iterator: nothing left to close)."""

    def __init__(self, trace: RequestTrace, outputs: AsyncIterator[EngineCoreOutput]) -> None:
        self.trace, self.outputs = trace, outputs

    def __aiter__(self) -> _Counted:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        out = await self.outputs.__anext__()
        self.trace.on_output(out)
        return out


def current_trace() -> RequestTrace | None:
    """The trace of the request being handled; None while tracing is off."""
    return _current.get()


def span(name: str) -> Any:
    """A child span of the current request (parse, tokenize); a null context when untraced."""
    trace = _current.get()
    return nullcontext() if trace is None else trace.child(name)


@contextmanager
def request_trace(headers: Mapping[str, str]) -> Iterator[RequestTrace | None]:
    """Open the root span of a request with W3C `headers` for its duration (current for
    `span` and GenerateJob); yields None while tracing is off."""
    tracer = tracing.tracer()
    if tracer is None:
        yield None
        return
    trace = RequestTrace(tracer, headers)
    token, trace_token = _current.set(trace), trace_id_var.set(trace.trace_id)
    error: BaseException | None = None
    try:
        yield trace
    except BaseException as exc:
        error = exc
        raise
    finally:
        trace.end(error)
        try:
            _current.reset(token)
            trace_id_var.reset(trace_token)
        except ValueError:  # an async generator closed from another context
            pass


def grpc_headers(context: Any) -> dict[str, str]:
    """The W3C trace headers of a gRPC call's metadata."""
    return tracing.trace_headers(dict(context.invocation_metadata() or ()))


def grpc_trace(context: Any) -> Any:
    """`request_trace` for a TextGeneration call; a null context while tracing is off."""
    if tracing.tracer() is None:
        return nullcontext()
    return request_trace(grpc_headers(context))


class TracingMiddleware:
    """Opens the root span of each request to a generate route (TRACED_PATHS)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        with request_trace(headers) as trace:

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start" and trace is not None:
                    trace.status_code = message["status"]
                await send(message)

            await self.app(scope, receive, send_status)
