"""Acceptance: one request sent with the official openai client and a W3C `traceparent`
to a real `tessera serve` (default model) exporting to an in-process OTLP collector is one
trace spanning the gateway, the scheduler and the worker; the public gRPC API takes the
context from metadata; `--log-format json` lines carry the request id and the trace id."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import openai
import pytest

from benchmarks.stack import Stack, start_stack
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from tests.otlp_collector import OtlpCollector, ReceivedSpan

pytestmark = pytest.mark.slow

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SERVICES = {"tessera-gateway", "tessera-scheduler", "tessera-worker"}


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    c = OtlpCollector()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stack(collector: OtlpCollector) -> Iterator[Stack]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within 0.2 s (the SDK's default: 5)
        s = start_stack(
            "--otlp-traces-endpoint", collector.endpoint, "--log-format", "json",
            "--max-num-seqs", "4",
        )  # fmt: skip
    yield s
    s.stop()


def _trace(collector: OtlpCollector, trace_id: str) -> list[ReceivedSpan]:
    """The spans of `trace_id` once each service sent its part (the scheduler's last)."""

    def complete(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        names = {s.name for s in mine}
        return {s.service for s in mine} == SERVICES and {"llm_request", "decode"} <= names

    return [s for s in collector.wait_for(complete, 20) if s.trace_id == trace_id]


def test_one_trace_spans_the_three_services(stack: Stack, collector: OtlpCollector) -> None:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": "e2e-1"},
    )
    spans = _trace(collector, TRACE_ID)
    assert {s.service for s in spans} == SERVICES
    by_name = {s.name: s for s in spans}
    names_by_service = {
        service: sorted(s.name for s in spans if s.service == service) for service in SERVICES
    }
    assert names_by_service == {
        "tessera-gateway": ["llm_request", "parse", "tokenize"],
        "tessera-scheduler": ["decode", "engine_request", "prefill", "queue"],
        "tessera-worker": ["execute_model"],  # sampled: the step that starts the request
    }
    root = by_name["llm_request"]
    assert root.parent_span_id == CLIENT_SPAN  # the client's span is the root's parent
    ids = {s.span_id: s for s in spans}
    for span in spans:  # every other span hangs off the root, inside this trace
        if span is not root:
            assert span.parent_span_id in ids, span
    request = by_name["engine_request"]
    assert request.parent_span_id == root.span_id
    assert by_name["execute_model"].parent_span_id == root.span_id
    for phase in ("queue", "prefill", "decode"):
        assert by_name[phase].parent_span_id == request.span_id
    assert by_name["queue"].end_ns == by_name["prefill"].start_ns
    assert by_name["prefill"].end_ns == by_name["decode"].start_ns
    assert reply.usage is not None
    a = root.attributes
    assert a["gen_ai.request.id"] == reply.id
    assert a["gen_ai.response.model"] == model
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.usage.prompt_tokens"] == reply.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == reply.usage.completion_tokens == 6
    assert 0 < a["gen_ai.latency.time_to_first_token"] < a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.time_in_queue"] >= 0
    assert request.attributes["gen_ai.request.id"] == f"{reply.id}-0"
    assert request.attributes["gen_ai.usage.completion_tokens"] == 6
    step = by_name["execute_model"].attributes
    assert step["tessera.step.num_tokens"] >= reply.usage.prompt_tokens
    assert step["gen_ai.latency.time_in_model_forward"] > 0
    # the JSON access log line of this request carries its request id and trace id
    access = [
        json.loads(line.split("] ", 1)[1])
        for line in stack.output().splitlines()
        if line.startswith("[gateway] {") and '"gateway.access"' in line
    ]
    mine = [e for e in access if e["request_id"] == "e2e-1"]
    assert mine and mine[0]["trace_id"] == TRACE_ID
    assert json.loads(mine[0]["message"])["path"] == "/v1/chat/completions"


def test_grpc_metadata_carries_the_context(stack: Stack, collector: OtlpCollector) -> None:
    trace_id, span_id = "1" * 32, "2" * 16
    with grpc.insecure_channel(stack.gateway_grpc_address) as channel:
        reply = pb_grpc.TextGenerationStub(channel).Complete(
            pb.CompletionRequest(prompt="Once upon", params=pb.TextSamplingParams(max_tokens=3)),
            metadata=[("traceparent", f"00-{trace_id}-{span_id}-01")],
        )
    assert reply.usage.completion_tokens == 3
    spans = _trace(collector, trace_id)
    assert {s.service for s in spans} == SERVICES
    (root,) = [s for s in spans if s.name == "llm_request"]
    assert root.parent_span_id == span_id
