"""The scheduler's spans of traced requests (services.tracing); built only while tracing.

Each traced request (one whose EngineCoreRequest carries `trace_headers`) gets, when it
finishes, a span `engine_request` under the gateway's `llm_request` with three children
recorded from the request's own timestamps, never one span per step:

    queue    queued -> first scheduled          gen_ai.latency.time_in_queue
    prefill  first scheduled -> first token     gen_ai.latency.time_in_model_prefill
    decode   first token -> finished            gen_ai.latency.time_in_model_decode

It also samples steps for the worker: `tag_step` (engine thread, once per step) puts the
traceparents of the step's traced requests in `SchedulerOutput.trace_contexts`, for the
step that first schedules each one, or for every step with `--collect-detailed-traces`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services import tracing
from services.step_types import SchedulerOutput
from services.tracing import SpanAttributes as A
from services.types import EngineCoreOutput, EngineCoreRequest

MAX_TRACED = 65536  # requests tracked at once; past it new ones go untraced


@dataclass(slots=True)
class _Traced:
    context: Any  # the gateway span's OpenTelemetry Context
    traceparent: str
    num_prompt_tokens: int
    num_output_tokens: int = 0


class RequestSpans:
    """Traced requests by id, from `add` until their final output went through `observe`."""

    def __init__(self, tracer: Any, every_step: bool = False) -> None:
        self.tracer = tracer
        self.every_step = every_step
        self.live: dict[str, _Traced] = {}

    def add(self, request: EngineCoreRequest) -> None:
        """Track `request` if it carries a trace context (event loop, before it is queued)."""
        parent = request.trace_headers.get("traceparent")
        if parent and len(self.live) < MAX_TRACED:
            context = tracing.extract_context(request.trace_headers)
            self.live[request.request_id] = _Traced(context, parent, len(request.prompt_token_ids))

    def discard(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def tag_step(self, output: SchedulerOutput) -> None:
        """Sample a step for the worker (engine thread; reads `live` only)."""
        live = self.live
        if not live:
            return
        if self.every_step:
            ids: Sequence[str] = list(output.num_scheduled_tokens)
        else:
            ids = [r.request_id for r in output.scheduled_new_reqs]  # first (or resumed) prefill
        parents = [t.traceparent for i in ids if (t := live.get(i)) is not None]
        if parents:
            output.trace_contexts = parents

    def observe(self, outputs: list[EngineCoreOutput]) -> None:
        """Count the traced requests' tokens; record the spans of those that finished."""
        live = self.live
        if not live:
            return
        for out in outputs:
            traced = live.get(out.request_id)
            if traced is None:
                continue
            traced.num_output_tokens += len(out.new_token_ids)
            if out.finished:
                del live[out.request_id]
                self._record(out, traced)

    def _record(self, out: EngineCoreOutput, traced: _Traced) -> None:
        now = time.time()
        ts = out.timestamps
        queued = ts.queued or now
        request_span = self.tracer.start_span(
            "engine_request",
            context=traced.context,
            start_time=tracing.ns(queued),
            attributes={
                A.GEN_AI_REQUEST_ID: out.request_id,
                A.GEN_AI_USAGE_PROMPT_TOKENS: traced.num_prompt_tokens,
                A.GEN_AI_USAGE_COMPLETION_TOKENS: traced.num_output_tokens,
                A.NUM_CACHED_TOKENS: out.num_cached_tokens,
                A.FINISH_REASON: out.finish_reason.name.lower(),
            },
        )
        phases = [
            ("queue", queued, ts.scheduled or now, A.GEN_AI_LATENCY_TIME_IN_QUEUE),
            (
                "prefill",
                ts.scheduled,
                ts.first_token or now,
                A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
            ),
            ("decode", ts.first_token, now, A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE),
        ]
        parent = tracing.span_context(request_span)
        for name, start, end, attribute in phases:
            if start:  # a phase the request never reached has no span
                span = self.tracer.start_span(
                    name,
                    context=parent,
                    start_time=tracing.ns(start),
                    attributes={attribute: end - start},
                )
                span.end(end_time=tracing.ns(end))
        if ts.scheduled:
            request_span.set_attribute(A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE, now - ts.scheduled)
        request_span.end(end_time=tracing.ns(now))
