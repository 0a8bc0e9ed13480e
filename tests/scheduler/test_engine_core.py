"""EngineCore in process: the KV handshake, admission checks, failing steps and lost workers."""

from __future__ import annotations

import pytest

from scheduler_service.engine import EngineCore
from scheduler_service.errors import WorkerLostError, WorkerUnavailableError
from services.config import CacheConfig, SchedulerConfig
from services.step_types import SchedulerOutput
from services.types import EngineCoreRequest, FinishReason, SamplingParams
from tests.scheduler.fake_worker import FakeWorker


def make_engine(
    *workers: FakeWorker, num_blocks_override: int = 0, async_scheduling: bool = True
) -> EngineCore:
    return EngineCore(
        SchedulerConfig(
            max_num_batched_tokens=32, max_num_seqs=8, async_scheduling=async_scheduling
        ),
        CacheConfig(num_blocks_override=num_blocks_override),
        list(workers),
    )


def req(request_id: str, prompt: list[int], **params: object) -> EngineCoreRequest:
    params.setdefault("max_tokens", 4)
    return EngineCoreRequest(request_id, prompt, SamplingParams(**params))  # type: ignore[arg-type]


def run(engine: EngineCore) -> dict[str, tuple[list[int], FinishReason, str]]:
    results: dict[str, tuple[list[int], FinishReason, str]] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step():
            tokens, _, _ = results.get(out.request_id, ([], FinishReason.UNSPECIFIED, ""))
            results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason, out.error)
    raise AssertionError("engine did not drain")


def test_handshake_takes_the_smallest_worker_and_initializes_all() -> None:
    a, b = FakeWorker(available_blocks=40), FakeWorker(available_blocks=25)
    engine = make_engine(a, b)
    assert engine.num_blocks == 25 and a.num_blocks == b.num_blocks == 25
    assert engine.scheduler.kv.num_blocks == 25
    info = engine.server_info()
    assert (info.num_blocks, info.block_size, info.num_workers) == (25, 4, 2)
    assert info.model_name == "fake" and info.vocab_size == 1000


def test_override_and_max_model_len_capped_to_the_pool() -> None:
    worker = FakeWorker(max_model_len=256)
    engine = make_engine(worker, num_blocks_override=10)
    assert worker.num_blocks == 10
    assert engine.max_model_len == 40  # 10 blocks x 4 tokens < 256
    assert engine.server_info().max_model_len == 40


def test_workers_must_agree_on_block_size() -> None:
    with pytest.raises(ValueError, match="block size"):
        make_engine(FakeWorker(block_size=4), FakeWorker(block_size=8))


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], {}, "at least one token"),
        ([5, 1000], {}, "token ids"),
        (list(range(40)), {}, "max_model_len"),
        (list(range(30)), {"min_tokens": 11, "max_tokens": 20}, "max_model_len"),
    ],
)
def test_requests_that_can_never_fit_are_refused(
    prompt: list[int], params: dict[str, int], message: str
) -> None:
    engine = make_engine(FakeWorker(), num_blocks_override=10)
    with pytest.raises(ValueError, match=message):
        engine.add_request(req("r", prompt, **params))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_step_that_raises_errors_its_requests_and_the_engine_goes_on(
    async_scheduling: bool,
) -> None:
    worker = FakeWorker()
    engine = make_engine(worker, async_scheduling=async_scheduling)
    engine.add_request(req("a", [1, 2, 3]))

    def explode(so: SchedulerOutput) -> None:
        if "a" in so.num_scheduled_tokens and len(worker.steps) == 2:
            raise RuntimeError("CUDA error: illegal memory access")

    worker.raise_on_step = explode
    results = run(engine)
    assert results["a"][1:] == (
        FinishReason.ERROR,
        "RuntimeError: CUDA error: illegal memory access",
    )
    assert results["a"][0] == [4]  # the token of step 1 only; nothing invented
    assert engine.healthy and engine.stats().num_blocks_used == 0
    engine.add_request(req("b", [7]))
    assert run(engine)["b"] == ([8, 9, 10, 11], FinishReason.LENGTH, "")
    # The worker hears of it in the next step scheduled after the failure was known
    # (async: step 3 had been sent already, while step 2 ran).
    assert worker.steps[3 if async_scheduling else 2].finished_req_ids == ["a"]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_an_unreachable_worker_fails_everything_and_marks_the_engine_unhealthy(
    async_scheduling: bool,
) -> None:
    worker = FakeWorker()
    config = SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=1, async_scheduling=async_scheduling
    )
    engine = EngineCore(config, CacheConfig(), [worker])
    engine.add_request(req("running", [1, 2]))
    engine.add_request(req("waiting", [3, 4]))

    def unreachable(so: SchedulerOutput) -> None:
        raise WorkerUnavailableError("worker 127.0.0.1:1: UNAVAILABLE: connection refused")

    worker.raise_on_step = unreachable
    with pytest.raises(WorkerLostError) as excinfo:
        engine.step()
        engine.step()  # async: the first call only started the step
    finals = {o.request_id: (o.finish_reason, o.error) for o in excinfo.value.outputs}
    assert set(finals) == {"running", "waiting"}
    assert all(reason == FinishReason.ERROR and "UNAVAILABLE" in e for reason, e in finals.values())
    assert not engine.healthy and not engine.stats().healthy
    assert engine.stats().num_blocks_used == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_stats_count_steps_prefix_hits_and_finishes(async_scheduling: bool) -> None:
    engine = make_engine(FakeWorker(), async_scheduling=async_scheduling)
    system = list(range(100, 116))
    engine.add_request(req("a", [*system, 1]))
    run(engine)
    engine.add_request(req("b", [*system, 2]))
    run(engine)
    stats = engine.stats()
    assert stats.num_finished == 2 and stats.num_steps == 8
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (34, 16)
    assert stats.step_time_p50 > 0 and stats.healthy
    assert stats.num_blocks_used == 0 and stats.num_blocks_total == 64
