"""The engine thread on its own: sleeps when idle, applies aborts between steps, dies loudly."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from scheduler_service.engine import EngineCore
from scheduler_service.engine_loop import EngineLoop
from services.config import CacheConfig, SchedulerConfig
from services.types import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from tests.scheduler.fake_worker import FakeWorker

pytestmark = pytest.mark.timeout(30)


class Collector:
    """Thread-safe sink for published outputs."""

    def __init__(self) -> None:
        self.outputs: list[EngineCoreOutput] = []
        self.finished = threading.Condition()

    def __call__(self, outputs: list[EngineCoreOutput]) -> None:
        with self.finished:
            self.outputs += outputs
            self.finished.notify_all()

    def wait_finished(self, request_id: str, timeout_s: float = 5.0) -> EngineCoreOutput:
        with self.finished:
            ok = self.finished.wait_for(lambda: self.final(request_id) is not None, timeout_s)
        assert ok, f"{request_id} did not finish"
        final = self.final(request_id)
        assert final is not None
        return final

    def final(self, request_id: str) -> EngineCoreOutput | None:
        return next((o for o in self.outputs if o.request_id == request_id and o.finished), None)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs if o.request_id == request_id for t in o.new_token_ids]


@pytest.fixture
def setup() -> Iterator[tuple[EngineLoop, FakeWorker, Collector]]:
    worker = FakeWorker()
    engine = EngineCore(SchedulerConfig(max_num_batched_tokens=16), CacheConfig(), [worker])
    sink = Collector()
    loop = EngineLoop(engine, sink)
    loop.start()
    yield loop, worker, sink
    loop.stop()


def req(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens))


def test_idle_loop_sleeps_without_stepping(setup: tuple[EngineLoop, FakeWorker, Collector]) -> None:
    loop, worker, sink = setup
    loop.submit(req("a", [1, 2], 3))
    assert sink.wait_finished("a").finish_reason == FinishReason.LENGTH
    steps = len(worker.steps)
    cpu_before = time.process_time()
    time.sleep(0.3)
    assert len(worker.steps) == steps  # no empty steps while idle
    assert time.process_time() - cpu_before < 0.1  # and no spinning
    loop.submit(req("b", [5], 2))  # wakes up on new work
    sink.wait_finished("b")
    assert sink.tokens("b") == [6, 7]


def test_abort_future_counts_found_requests(
    setup: tuple[EngineLoop, FakeWorker, Collector],
) -> None:
    loop, worker, sink = setup
    worker.step_delay_s = 0.01
    loop.submit(req("long", [1], 1000))
    assert loop.abort(["long", "missing"]).result(timeout=5) == 1
    assert sink.wait_finished("long").finish_reason == FinishReason.ABORT
    assert loop.abort(["long"]).result(timeout=5) == 0
    assert loop.engine.stats().num_blocks_used == 0


def test_invalid_request_raises_in_the_caller(
    setup: tuple[EngineLoop, FakeWorker, Collector],
) -> None:
    loop, _, _ = setup
    with pytest.raises(ValueError, match="at least one token"):
        loop.submit(req("empty", [], 1))


def test_a_crashing_loop_fails_requests_and_reports_unhealthy() -> None:
    worker = FakeWorker(step_delay_s=0.01)
    engine = EngineCore(SchedulerConfig(), CacheConfig(), [worker])
    sink = Collector()
    changed = threading.Event()
    loop = EngineLoop(engine, sink, changed.set)
    loop.start()
    loop.submit(req("r", [1], 1000))
    time.sleep(0.05)

    def broken(on_scheduled: object = None) -> list[EngineCoreOutput]:
        raise AssertionError("scheduler bug")

    engine.step = broken  # type: ignore[method-assign]
    final = sink.wait_finished("r")
    assert final.finish_reason == FinishReason.ERROR and "scheduler bug" in final.error
    assert changed.wait(5) and not loop.healthy
    with pytest.raises(RuntimeError, match="not serving"):
        loop.submit(req("s", [1], 1))
    loop.stop()
