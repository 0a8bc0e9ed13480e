"""The shared channel helper retries idempotent internal calls on UNAVAILABLE (gRPC
service-config retry policy) and never retries the others; health answers tell "down"
from "up but NOT_SERVING" (what the worker reports before its KV handshake)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services import healthcheck
from services.grpc_utils import GrpcServer, Registration, aio_channel, health_status
from services.pb import engine_pb2, engine_pb2_grpc
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(60)


class Flaky(engine_pb2_grpc.EngineCoreServicer):
    """Answers UNAVAILABLE to the first `failures` calls of each method, then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, int] = {}

    async def _maybe_fail(self, name: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[name] <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._maybe_fail("GetStats", context)
        return engine_pb2.SchedulerStats(num_running=7)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._maybe_fail("Abort", context)
        return engine_pb2.AbortResponse(num_aborted=1)

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._maybe_fail("GetServerInfo", context)
        return engine_pb2.ServerInfo(model_name="flaky")

    async def GenerateStream(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        await self._maybe_fail("GenerateStream", context)
        async for command in request_iterator:
            if command.add.request_id == "bad":
                raise ValueError("no such thing as a bad request")
            yield engine_pb2.EngineCoreOutputs()


async def _serve(servicer: Flaky) -> GrpcServer:
    registration = Registration(
        "tessera.v1.EngineCore", engine_pb2_grpc.add_EngineCoreServicer_to_server, servicer
    )
    server = GrpcServer("127.0.0.1:0", [registration])
    await server.start()
    return server


def test_idempotent_calls_are_retried_and_generate_is_not() -> None:
    async def body() -> None:
        servicer = Flaky(failures=2)
        server = await _serve(servicer)
        async with aio_channel(f"127.0.0.1:{server.port}") as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            stats = await stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)
            assert stats.num_running == 7 and servicer.calls["GetStats"] == 3
            reply = await stub.Abort(engine_pb2.AbortRequest(request_ids=["x"]), timeout=10)
            assert reply.num_aborted == 1 and servicer.calls["Abort"] == 3
            add = engine_pb2.EngineCoreCommand(add=engine_pb2.EngineCoreRequest(request_id="g"))
            call = stub.GenerateStream(iter([add]), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await call.read()
            assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
            assert servicer.calls["GenerateStream"] == 1
        await server.stop(0)

    asyncio.run(body())


def test_retries_are_bounded() -> None:
    async def body() -> None:
        servicer = Flaky(failures=10)
        server = await _serve(servicer)
        async with aio_channel(f"127.0.0.1:{server.port}") as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)
            assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
            assert servicer.calls["GetStats"] == 3  # maxAttempts
        await server.stop(0)

    asyncio.run(body())


def test_health_status_tells_down_from_not_serving() -> None:
    async def body() -> None:
        server = await _serve(Flaky(0))
        await server.set_serving(False)
        address = f"127.0.0.1:{server.port}"
        assert await asyncio.to_thread(health_status, address) == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
        assert await asyncio.to_thread(healthcheck.main, ["grpc", "--up", address]) == 0
        assert await asyncio.to_thread(healthcheck.main, ["grpc", address]) == 1
        await server.set_serving(True)
        assert await asyncio.to_thread(healthcheck.main, ["grpc", address]) == 0
        await server.stop(0)
        down = f"127.0.0.1:{free_port()}"
        assert await asyncio.to_thread(health_status, down, "", 1.0) is None
        assert await asyncio.to_thread(healthcheck.main, ["grpc", "--up", down]) == 1

    asyncio.run(body())


def test_an_exception_in_a_bidirectional_stream_becomes_its_status() -> None:
    async def body() -> None:
        server = await _serve(Flaky(0))
        async with aio_channel(f"127.0.0.1:{server.port}") as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            for request_id in ("ok", "bad"):
                add = engine_pb2.EngineCoreRequest(request_id=request_id)
                call = stub.GenerateStream(timeout=10)
                await call.write(engine_pb2.EngineCoreCommand(add=add))
                if request_id == "ok":
                    assert await call.read() == engine_pb2.EngineCoreOutputs()
                    await call.done_writing()
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await call.read()
                assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "no such thing as a bad request" in (excinfo.value.details() or "")
            stats = await stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)
            assert stats.num_running == 7  # the server lives on
        await server.stop(0)

    asyncio.run(body())
