"""The real EngineCore gRPC service against a fake worker behind the real Worker gRPC service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_service.engine import EngineCore
from scheduler_service.service import EngineCoreServer
from scheduler_service.worker_client import GrpcWorkerClient
from services.config import CacheConfig, SchedulerConfig
from services.convert import to_proto
from services.grpc_utils import GrpcServer, aio_channel
from services.pb import engine_pb2, engine_pb2_grpc
from services.step_types import SchedulerOutput
from services.types import EngineCoreRequest, SamplingParams
from tests.engine_session import OneRequest
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import expected_tokens
from worker_service.server import build_server

pytestmark = pytest.mark.timeout(60)


class Stack:
    """Fake worker -> Worker gRPC service -> GrpcWorkerClient -> EngineCore -> EngineCore service."""

    def __init__(self, worker: FakeWorker, **scheduler: Any) -> None:
        self.worker = worker
        self.scheduler_config = SchedulerConfig(**scheduler)
        self.worker_server: GrpcServer
        self.server: EngineCoreServer
        self.stub: engine_pb2_grpc.EngineCoreStub

    async def __aenter__(self) -> Stack:
        self.worker_server = build_server("127.0.0.1:0", self.worker)
        await self.worker_server.start()
        await self.worker_server.set_serving(True)
        worker_address = f"127.0.0.1:{self.worker_server.port}"
        client = GrpcWorkerClient(worker_address, step_timeout_s=10)
        engine = await asyncio.to_thread(EngineCore, self.scheduler_config, CacheConfig(), [client])
        self.server = EngineCoreServer("127.0.0.1:0", engine, [worker_address], 0.2)
        await self.server.start()
        self.channel = aio_channel(f"127.0.0.1:{self.server.port}")
        self.stub = engine_pb2_grpc.EngineCoreStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(0.5)
        await self.worker_server.stop(0.5)

    def generate(self, request_id: str, prompt: list[int], **params: Any) -> OneRequest:
        params.setdefault("max_tokens", 8)
        request = EngineCoreRequest(request_id, prompt, SamplingParams(**params))
        return OneRequest(self.stub, to_proto(request, engine_pb2.EngineCoreRequest))

    async def collect(
        self, request_id: str, prompt: list[int], **params: Any
    ) -> tuple[list[int], Any]:
        tokens: list[int] = []
        last = None
        async for out in self.generate(request_id, prompt, **params):
            tokens += out.new_token_ids
            last = out
        return tokens, last

    async def stats(self) -> Any:
        return await self.stub.GetStats(engine_pb2.GetStatsRequest())

    async def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="tessera.v1.EngineCore"))
        return int(reply.status)


async def read_rest(call: OneRequest) -> list[Any]:
    """The remaining outputs of a request read with call.read()."""
    outputs = []
    while (out := await call.read()) is not grpc.aio.EOF:
        outputs.append(out)
    return outputs


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_concurrent_streams_finish_correctly() -> None:
    async def body() -> None:
        async with Stack(FakeWorker(), max_num_batched_tokens=16, max_num_seqs=4) as s:
            info = await s.stub.GetServerInfo(engine_pb2.GetServerInfoRequest())
            assert (info.model_name, info.block_size, info.num_blocks) == ("fake", 4, 64)
            prompts = {f"r{i}": [10 * i + j for j in range(1, 3 + 3 * i)] for i in range(10)}
            results = await asyncio.gather(
                *(s.collect(rid, p, max_tokens=5 + i) for i, (rid, p) in enumerate(prompts.items()))
            )
            for i, (rid, prompt) in enumerate(prompts.items()):
                tokens, last = results[i]
                assert tokens == expected_tokens(prompt, 5 + i), rid
                assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
            stats = await s.stats()
            assert (stats.num_finished, stats.num_running, stats.num_blocks_used) == (10, 0, 0)
            assert stats.healthy and await s.health() == health_pb2.HealthCheckResponse.SERVING

    run(body)


def test_cancelling_a_stream_frees_its_blocks_within_one_step() -> None:
    async def body() -> None:
        worker = FakeWorker(step_delay_s=0.02)
        async with Stack(worker) as s:
            other = asyncio.create_task(s.collect("other", [5, 6, 7], max_tokens=30))
            call = s.generate("victim", list(range(1, 10)), max_tokens=200)
            seen = 0
            async for _ in call:
                seen += 1
                if seen == 3:
                    break
            steps_at_cancel = len(worker.steps)
            call.cancel()
            await eventually(lambda: _blocks_only_of(s, "other"))
            after = worker.steps[steps_at_cancel:]
            # At most the steps already scheduled: one running (sync) plus one sent ahead (async).
            assert sum("victim" in so.num_scheduled_tokens for so in after) <= 2
            await eventually(lambda: _told_worker(worker, "victim", steps_at_cancel))
            await eventually(lambda: _dropped(worker, "victim"))
            tokens, _ = await other
            assert tokens == expected_tokens([5, 6, 7], 30)

    run(body)


async def _blocks_only_of(s: Stack, request_id: str) -> bool:
    scheduler = s.server.servicer.engine.scheduler
    return set(scheduler.requests) == {request_id} and (await s.stats()).num_running == 1


async def _told_worker(worker: FakeWorker, request_id: str, since: int) -> bool:
    return any(request_id in so.finished_req_ids for so in worker.steps[since : since + 3])


async def _dropped(worker: FakeWorker, request_id: str) -> bool:
    return request_id not in worker.requests


def test_abort_by_id_ends_the_stream_with_abort() -> None:
    async def body() -> None:
        async with Stack(FakeWorker(step_delay_s=0.01)) as s:
            call = s.generate("a", [1, 2, 3], max_tokens=500)
            first = await call.read()
            assert list(first.new_token_ids) == [4]
            reply = await s.stub.Abort(engine_pb2.AbortRequest(request_ids=["a", "nope"]))
            assert reply.num_aborted == 1
            outputs = await read_rest(call)
            assert outputs[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT
            assert (await s.stats()).num_blocks_used == 0

    run(body)


def test_requests_that_cannot_fit_get_invalid_argument() -> None:
    async def body() -> None:
        async with Stack(FakeWorker(max_model_len=64)) as s:
            for prompt, params in (
                (list(range(64)), {}),
                ([1, 2], {"min_tokens": 63, "max_tokens": 63}),
                ([5000], {}),
                ([], {}),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await s.collect("bad", prompt, **params)
                assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            bad_params = engine_pb2.EngineCoreRequest(
                request_id="t",
                prompt_token_ids=[1],
                sampling_params=engine_pb2.SamplingParams(temperature=-1.0),
            )
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await OneRequest(s.stub, bad_params).read()
            assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "temperature" in (excinfo.value.details() or "")
            tokens, _ = await s.collect("ok", [1, 2], max_tokens=3)  # still serving
            assert tokens == [3, 4, 5]

    run(body)


def test_a_worker_that_raises_errors_the_affected_requests_and_service_continues() -> None:
    async def body() -> None:
        worker = FakeWorker()
        async with Stack(worker) as s:

            def explode(so: SchedulerOutput) -> None:
                if "doomed" in so.num_scheduled_tokens:
                    raise RuntimeError("kernel exploded")

            worker.raise_on_step = explode
            tokens, last = await s.collect("doomed", [1, 2, 3])
            assert tokens == [] and last.finish_reason == engine_pb2.FINISH_REASON_ERROR
            assert "kernel exploded" in last.error
            worker.raise_on_step = None
            worker.fail_requests["bad"] = "nan logits"
            results = await asyncio.gather(
                s.collect("good", [7, 8], max_tokens=4), s.collect("bad", [9], max_tokens=4)
            )
            assert results[0][0] == [9, 10, 11, 12]
            assert results[1][1].finish_reason == engine_pb2.FINISH_REASON_ERROR
            assert results[1][1].error == "nan logits"
            assert await s.health() == health_pb2.HealthCheckResponse.SERVING
            assert (await s.stats()).num_blocks_used == 0

    run(body)


def test_a_lost_worker_fails_in_flight_requests_and_reports_not_serving() -> None:
    async def body() -> None:
        async with Stack(FakeWorker(step_delay_s=0.02), max_num_seqs=1) as s:
            running = s.generate("running", [1, 2], max_tokens=500)
            await running.read()
            waiting = asyncio.create_task(s.collect("waiting", [3, 4], max_tokens=5))
            await eventually(lambda: _num_waiting_is(s, 1))  # max_num_seqs = 1
            await s.worker_server.stop(0)
            outputs = await read_rest(running)
            assert outputs[-1].finish_reason == engine_pb2.FINISH_REASON_ERROR
            assert "worker" in outputs[-1].error
            _, last = await waiting
            assert last.finish_reason == engine_pb2.FINISH_REASON_ERROR
            await eventually(lambda: _health_is(s, health_pb2.HealthCheckResponse.NOT_SERVING))
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await s.collect("late", [1])
            assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
            stats = await s.stats()
            assert not stats.healthy and stats.num_blocks_used == 0

    run(body)


def test_an_idle_worker_that_stops_answering_turns_health_not_serving() -> None:
    async def body() -> None:
        async with Stack(FakeWorker()) as s:
            assert await s.health() == health_pb2.HealthCheckResponse.SERVING
            await s.worker_server.stop(0)
            await eventually(lambda: _health_is(s, health_pb2.HealthCheckResponse.NOT_SERVING))
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await s.collect("late", [1])
            assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE

    run(body)


async def _num_waiting_is(s: Stack, n: int) -> bool:
    return int((await s.stats()).num_waiting) == n


async def _health_is(s: Stack, status: int) -> bool:
    return await s.health() == status


def test_unset_max_tokens_means_up_to_max_model_len() -> None:
    async def body() -> None:
        async with Stack(FakeWorker(max_model_len=24)) as s:
            msg = engine_pb2.EngineCoreRequest(request_id="long", prompt_token_ids=[1, 2, 3, 4])
            outputs = await read_rest(OneRequest(s.stub, msg))
            assert sum(len(o.new_token_ids) for o in outputs) == 20
            assert outputs[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH

    run(body)


def test_a_request_id_already_in_flight_is_refused() -> None:
    async def body() -> None:
        async with Stack(FakeWorker(step_delay_s=0.01)) as s:
            first = s.generate("dup", [1], max_tokens=500)
            await first.read()
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await s.collect("dup", [2])
            assert excinfo.value.code() == grpc.StatusCode.ALREADY_EXISTS
            await s.stub.Abort(engine_pb2.AbortRequest(request_ids=["dup"]))
            outputs = await read_rest(first)
            assert outputs[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT

    run(body)


def test_the_scheduler_figures_ride_on_the_session_stream() -> None:
    """The message that finishes a request carries the figures after that step; the router
    reads load from there instead of polling GetStats."""

    async def body() -> None:
        async with Stack(FakeWorker()) as s:
            request = EngineCoreRequest("ride", [1, 2, 3], SamplingParams(max_tokens=4))
            add = engine_pb2.EngineCoreCommand(add=to_proto(request, engine_pb2.EngineCoreRequest))
            messages = [m async for m in s.stub.GenerateStream(iter([add]))]
            assert messages[0].HasField("stats")  # the first update of the session
            last = messages[-1]
            assert last.outputs[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
            assert last.HasField("stats")
            assert (last.stats.num_running, last.stats.num_finished) == (0, 1)
            assert last.stats.healthy and last.stats.num_blocks_used == 0

    run(body)
