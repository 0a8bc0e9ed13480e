"""The EngineCore service survives its worker: a worker lost mid-stream or restarted while
idle ends every request with ERROR, health turns NOT_SERVING (new requests are refused at
once with UNAVAILABLE), and once a worker answers again on the same address the scheduler
repeats the KV handshake and serves again, with no restart of its own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from scheduler_service.engine import WORKER_LOST, EngineCore
from scheduler_service.service import EngineCoreServer
from scheduler_service.worker_client import GrpcWorkerClient
from services.config import CacheConfig
from services.grpc_utils import GrpcServer, aio_channel
from services.pb import engine_pb2, engine_pb2_grpc
from tests.conftest import free_port
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import expected_tokens
from tests.scheduler.test_service import Stack, eventually, read_rest, run
from worker_service.server import build_server

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RestartableStack(Stack):
    """`Stack` with the worker on a fixed port, so a new worker can take its place."""

    async def __aenter__(self) -> RestartableStack:
        self.worker_port = free_port()
        self.worker_server = await self.start_worker(self.worker)
        worker_address = f"127.0.0.1:{self.worker_port}"
        client = GrpcWorkerClient(worker_address, step_timeout_s=10)
        engine = await asyncio.to_thread(EngineCore, self.scheduler_config, CacheConfig(), [client])
        self.server = EngineCoreServer("127.0.0.1:0", engine, [worker_address], 0.2)
        await self.server.start()
        self.channel = aio_channel(f"127.0.0.1:{self.server.port}")
        self.stub = engine_pb2_grpc.EngineCoreStub(self.channel)
        return self

    async def start_worker(self, worker: FakeWorker) -> GrpcServer:
        """A worker service as a fresh process would be: NOT_SERVING until InitializeCache."""
        server = build_server(f"127.0.0.1:{self.worker_port}", worker)
        await server.set_serving(False)
        await server.start()
        return server

    async def restart_worker(self, worker: FakeWorker) -> None:
        await self.worker_server.stop(0)
        self.worker = worker
        self.worker_server = await self.start_worker(worker)


async def _health_is(s: Stack, status: int) -> bool:
    return await s.health() == status


async def _waiting_is(s: Stack, count: int) -> bool:
    return (await s.stats()).num_waiting == count


async def _refused_at_once(s: Stack) -> None:
    """A request while not serving is refused with UNAVAILABLE well within a second."""
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await s.collect(f"refused-{start}", [1])
    assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 1.0


async def _serves_correctly(s: Stack, request_id: str) -> None:
    tokens, last = await s.collect(request_id, [5, 6, 7], max_tokens=6)
    assert tokens == expected_tokens([5, 6, 7], 6, 1000)
    assert last.finish_reason == engine_pb2.FINISH_REASON_LENGTH


def test_a_worker_restarted_mid_stream_errors_in_flight_requests_then_serves_again() -> None:
    async def body() -> None:
        async with RestartableStack(FakeWorker(step_delay_s=0.02), max_num_seqs=2) as s:
            await _serves_correctly(s, "before")  # fills the prefix cache too
            calls = [s.generate(f"r{i}", [1, 2, 3, 4, 5], max_tokens=200) for i in range(2)]
            for call in calls:
                await call.read()  # both run (max_num_seqs = 2) ...
            calls.append(s.generate("r2", [1, 2, 3, 4, 5], max_tokens=200))
            await eventually(lambda: _waiting_is(s, 1), timeout_s=5)  # ... and the third waits
            await s.restart_worker(FakeWorker(step_delay_s=0.02, available_blocks=48))
            for call in calls:
                last: Any = (await read_rest(call))[-1]
                assert last.finish_reason == engine_pb2.FINISH_REASON_ERROR
                assert WORKER_LOST in last.error
            await eventually(lambda: _health_is(s, SERVING), timeout_s=10)
            stats = await s.stats()
            assert stats.healthy and stats.num_blocks_used == 0 and stats.num_running == 0
            info = await s.stub.GetServerInfo(engine_pb2.GetServerInfoRequest())
            assert info.num_blocks == 48  # the new worker's handshake, not the old one's
            assert s.worker.num_blocks == 48
            # The new worker's KV is empty: a prefix-cache hit on the old blocks would trip
            # FakeWorker's fingerprint checks (ContractError -> a failed step).
            await _serves_correctly(s, "after")
            assert (await s.stats()).num_blocks_used == 0

    run(body)


def test_an_idle_worker_restart_is_noticed_and_requests_meanwhile_are_refused() -> None:
    async def body() -> None:
        async with RestartableStack(FakeWorker()) as s:
            await _serves_correctly(s, "before")
            await s.worker_server.stop(0)
            await eventually(lambda: _health_is(s, NOT_SERVING))
            await _refused_at_once(s)
            s.worker = FakeWorker()
            s.worker_server = await s.start_worker(s.worker)
            await eventually(lambda: _health_is(s, SERVING), timeout_s=10)
            await _serves_correctly(s, "after")
            assert (await s.stats()).num_blocks_used == 0

    run(body)


def test_a_handshake_that_fails_is_retried() -> None:
    async def body() -> None:
        async with RestartableStack(FakeWorker()) as s:
            broken = FakeWorker()
            broken.available_blocks = 0  # "no room for a single KV block": handshake fails
            await s.restart_worker(broken)
            await eventually(lambda: _health_is(s, NOT_SERVING))
            await asyncio.sleep(0.6)  # a few probe rounds, each trying the handshake
            assert await s.health() == NOT_SERVING
            await _refused_at_once(s)
            await s.restart_worker(FakeWorker())
            await eventually(lambda: _health_is(s, SERVING), timeout_s=10)
            await _serves_correctly(s, "after")

    run(body)
