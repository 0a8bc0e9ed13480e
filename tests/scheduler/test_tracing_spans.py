"""The scheduler's request spans and step sampling (scheduler_service.tracing), through a
real EngineCore and the contract-checking fake worker, spans to an in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from scheduler_service.engine import EngineCore
from scheduler_service.tracing import RequestSpans
from services.step_types import ModelRunnerOutput, SchedulerOutput
from services.types import EngineCoreOutput, EngineCoreRequest, SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.test_engine_core import make_engine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


class RecordingWorker(FakeWorker):
    """The fake worker, keeping each step's trace_contexts."""

    def __init__(self) -> None:
        super().__init__()
        self.trace_steps: list[list[str]] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.trace_steps.append(list(scheduler_output.trace_contexts))
        return super().execute_model(scheduler_output)


def _traced_engine(
    every_step: bool,
) -> tuple[EngineCore, RecordingWorker, RequestSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    worker = RecordingWorker()
    engine = make_engine(worker, async_scheduling=False)
    spans = RequestSpans(provider.get_tracer("test"), every_step)
    engine.on_schedule = spans.tag_step
    return engine, worker, spans, exporter


def _drain(engine: EngineCore, spans: RequestSpans) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return outputs
        step = engine.step()
        spans.observe(step)  # what EngineCoreServicer._dispatch does
        outputs += step
    raise AssertionError("engine did not drain")


def _request(request_id: str, traced: bool, max_tokens: int = 4) -> EngineCoreRequest:
    headers = {"traceparent": TRACEPARENT} if traced else {}
    return EngineCoreRequest(
        request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens), trace_headers=headers
    )


def _add(engine: EngineCore, spans: RequestSpans, request: EngineCoreRequest) -> None:
    spans.add(request)
    engine.add_request(request)


@pytest.mark.parametrize("every_step", [False, True], ids=["first-step", "every-step"])
def test_steps_of_traced_requests_are_sampled(every_step: bool) -> None:
    engine, worker, spans, _ = _traced_engine(every_step)
    _add(engine, spans, _request("traced", True))
    _add(engine, spans, _request("plain", False))
    _drain(engine, spans)
    tagged = [s for s in worker.trace_steps if s]
    assert all(s == [TRACEPARENT] for s in tagged)  # never the untraced request's
    # 1 prefill step + 3 more decode steps for 4 tokens
    assert len(tagged) == (4 if every_step else 1)
    assert worker.trace_steps[0] == [TRACEPARENT]  # the step that starts the request
    assert spans.live == {}  # nothing kept once the request finished


def _span(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


def test_request_spans_follow_the_requests_timestamps() -> None:
    engine, _, spans, exporter = _traced_engine(False)
    _add(engine, spans, _request("traced", True, max_tokens=6))
    _add(engine, spans, _request("plain", False))
    outputs = _drain(engine, spans)
    final = next(o for o in outputs if o.request_id == "traced" and o.finished)
    got = exporter.get_finished_spans()
    assert sorted(s.name for s in got) == ["decode", "engine_request", "prefill", "queue"]
    request = _span(got, "engine_request")
    assert f"{request.context.trace_id:032x}" == TRACE_ID
    assert request.parent is not None and f"{request.parent.span_id:016x}" == PARENT
    a = request.attributes or {}
    assert a["gen_ai.request.id"] == "traced"
    assert a["gen_ai.usage.prompt_tokens"] == 5
    assert a["gen_ai.usage.completion_tokens"] == 6
    assert a["tessera.finish_reason"] == "length"
    ts = final.timestamps
    queue, prefill, decode = (_span(got, n) for n in ("queue", "prefill", "decode"))
    for phase in (queue, prefill, decode):
        assert phase.parent is not None and phase.parent.span_id == request.context.span_id
    assert queue.start_time == request.start_time == int(ts.queued * 1e9)
    assert queue.end_time == prefill.start_time == int(ts.scheduled * 1e9)
    assert prefill.end_time == decode.start_time == int(ts.first_token * 1e9)
    assert decode.end_time == request.end_time
    assert (queue.attributes or {})["gen_ai.latency.time_in_queue"] == pytest.approx(
        ts.scheduled - ts.queued
    )


def test_an_aborted_waiting_request_has_only_its_queue_span() -> None:
    engine, _, spans, exporter = _traced_engine(False)
    _add(engine, spans, _request("traced", True))
    spans.observe(engine.abort_requests(["traced"]))
    assert [s.name for s in exporter.get_finished_spans()] == ["queue", "engine_request"]
    assert (exporter.get_finished_spans()[1].attributes or {})["tessera.finish_reason"] == "abort"
    assert spans.live == {}
