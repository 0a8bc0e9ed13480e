"""Gateway tracing and JSON logs, in process: the fake EngineCore behind a gateway whose
spans go to an in-memory exporter (the OTLP path is tests/stack/test_tracing_serve.py)."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.tokenizer import Tokenizer
from services import tracing
from services.log import setup_logging
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from tests.gateway.conftest import Stack, start_stack
from tests.gateway.fake_engine import MODEL_NAME

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(tokenizer: Tokenizer, exporter: InMemorySpanExporter) -> Iterator[Stack]:
    """A gateway built while the process traces into `exporter`."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tessera-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracing, "_tracer", provider.get_tracer("tessera"))
        stack = start_stack(tokenizer)
        yield stack
        stack.stop()


@pytest.fixture
def spans(traced: Stack, exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    exporter.clear()
    traced.engine.reset()
    yield exporter


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)


def _finished(exporter: InMemorySpanExporter, roots: int = 1) -> tuple[ReadableSpan, ...]:
    """The finished spans once `roots` llm_request spans ended (the root ends just after
    the response's last byte went out, so a client may read it first)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got = exporter.get_finished_spans()
        if sum(s.name == "llm_request" for s in got) >= roots:
            return got
        time.sleep(0.01)
    return exporter.get_finished_spans()


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def _hex(value: int, digits: int) -> str:
    return f"{value:0{digits}x}"


def test_rest_request_continues_the_clients_trace(traced: Stack, spans: Any) -> None:
    reply = _client(traced).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=50,
        temperature=0.5,
        extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"},
    )
    got = _by_name(_finished(spans))
    assert {"llm_request", "parse", "tokenize"} <= set(got)
    root = got["llm_request"]
    assert _hex(root.context.trace_id, 32) == TRACE_ID
    assert root.parent is not None and _hex(root.parent.span_id, 16) == CLIENT_SPAN
    for child in ("parse", "tokenize"):
        parent = got[child].parent
        assert parent is not None and parent.span_id == root.context.span_id
        assert got[child].context.trace_id == root.context.trace_id
    a: dict[str, Any] = dict(root.attributes or {})
    assert a["gen_ai.request.id"] == reply.model_dump()["id"]
    assert a["gen_ai.response.model"] == MODEL_NAME
    assert a["gen_ai.request.max_tokens"] == 50
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.n"] == 1
    assert reply.usage is not None
    assert a["gen_ai.usage.prompt_tokens"] == reply.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == reply.usage.completion_tokens
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["http.response.status_code"] == 200
    # the engine request carries the root span as its parent (W3C, with the tracestate)
    (request,) = traced.engine.requests
    assert request.trace_headers["traceparent"] == (
        f"00-{TRACE_ID}-{_hex(root.context.span_id, 16)}-01"
    )
    assert request.trace_headers["tracestate"] == "vendor=1"


def test_without_traceparent_a_request_starts_its_own_trace(traced: Stack, spans: Any) -> None:
    _client(traced).completions.create(model=MODEL_NAME, prompt="Once", max_tokens=3)
    root = _by_name(_finished(spans))["llm_request"]
    assert root.parent is None
    assert _hex(root.context.trace_id, 32) != TRACE_ID
    (request,) = traced.engine.requests
    assert _hex(root.context.trace_id, 32) in request.trace_headers["traceparent"]


def test_non_generate_routes_are_not_traced(traced: Stack, spans: Any) -> None:
    _client(traced).models.list()
    assert spans.get_finished_spans() == ()


def test_grpc_metadata_traceparent(traced: Stack, spans: Any) -> None:
    with grpc.insecure_channel(traced.grpc_address) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        stub.Complete(
            pb.CompletionRequest(prompt="Once", params=pb.TextSamplingParams(max_tokens=3)),
            metadata=[("traceparent", TRACEPARENT)],
        )
        chunks = list(
            stub.ChatStream(
                pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")]),
                metadata=[("traceparent", TRACEPARENT)],
            )
        )
    assert chunks
    roots = [s for s in _finished(spans, 2) if s.name == "llm_request"]
    assert len(roots) == 2
    for root in roots:
        assert _hex(root.context.trace_id, 32) == TRACE_ID
        assert root.parent is not None and _hex(root.parent.span_id, 16) == CLIENT_SPAN
    assert len(traced.engine.requests) == 2
    assert all(TRACE_ID in r.trace_headers["traceparent"] for r in traced.engine.requests)


def test_json_log_lines_carry_request_and_trace_ids(traced: Stack, spans: Any) -> None:
    root_logger = logging.getLogger()
    saved = root_logger.handlers[:], root_logger.level
    buffer = io.StringIO()
    setup_logging("gateway", "INFO", "json", stream=buffer)
    try:
        response = _client(traced).chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=3,
            extra_headers={"traceparent": TRACEPARENT, "x-request-id": "req-json-1"},
        )
        deadline = time.monotonic() + 5  # the access line is written after the last byte
        while '"gateway.access"' not in buffer.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        root_logger.handlers[:], level = saved
        root_logger.setLevel(level)
    assert response.headers["x-request-id"] == "req-json-1"
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    access = [e for e in lines if e["logger"] == "gateway.access"]
    assert access, buffer.getvalue()
    entry = access[-1]
    assert set(entry) >= {"time", "level", "service", "request_id", "logger", "message"}
    assert entry["request_id"] == "req-json-1"
    assert entry["trace_id"] == TRACE_ID
    assert entry["service"] == "gateway"
    assert json.loads(entry["message"])["path"] == "/v1/chat/completions"


def test_embedding_requests_are_traced(
    tokenizer: Tokenizer, traced: Stack, exporter: InMemorySpanExporter
) -> None:
    """/v1/embeddings: the root, tokenize, and the context on every engine request."""
    exporter.clear()
    pooling = start_stack(tokenizer, runner="pooling")  # built while `traced` traces
    try:
        reply = _client(pooling).embeddings.create(
            model=MODEL_NAME, input=["one", "two"], extra_headers={"traceparent": TRACEPARENT}
        )
    finally:
        pooling.stop()
    got = _by_name(_finished(exporter))
    root = got["llm_request"]
    assert root.parent is not None and _hex(root.parent.span_id, 16) == CLIENT_SPAN
    assert "tokenize" in got
    assert (root.attributes or {})["gen_ai.request.id"] == reply.model_dump()["id"]
    assert (root.attributes or {})["gen_ai.usage.prompt_tokens"] == reply.usage.prompt_tokens
    assert len(pooling.engine.requests) == 2
    assert all(TRACE_ID in r.trace_headers["traceparent"] for r in pooling.engine.requests)
