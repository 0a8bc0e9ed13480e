"""Async client of the scheduler's `tessera.v1.EngineCore` gRPC service.

`generate()` returns a stream that is also an async context manager: leaving
the `async with` block early (stop string, client disconnect, task
cancellation) cancels the gRPC call, which aborts the request in the scheduler.
gRPC failures surface as `ServiceUnavailable` (engine unreachable) or
`EngineError`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.errors import ApiError, EngineError, InvalidRequest, ServiceUnavailable
from services.convert import from_proto, to_proto
from services.grpc_utils import aio_channel
from services.pb import engine_pb2, engine_pb2_grpc
from services.step_types import SchedulerStats, ServerInfo
from services.types import EngineCoreOutput, EngineCoreRequest

HEALTH_CACHE_S = 1.0  # how long one health answer is reused
RPC_TIMEOUT_S = 5.0  # unary calls (info, stats, abort, health)


def error_from_rpc(exc: grpc.aio.AioRpcError) -> ApiError:
    """The client-facing error for a failed EngineCore call."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServiceUnavailable(f"the engine is unavailable: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ServiceUnavailable(f"the engine is overloaded: {details}")
    return EngineError(f"the engine failed: {details}")


class EngineStream:
    """The outputs of one Generate call; cancel it by leaving `async with` or `cancel()`."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def cancel(self) -> None:
        """Cancel the call (the scheduler aborts the request); no-op when it is done."""
        if not self._call.done():
            self._call.cancel()

    async def __aenter__(self) -> EngineStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    async def __aiter__(self) -> AsyncIterator[EngineCoreOutput]:
        try:
            async for msg in self._call:
                yield from_proto(msg, EngineCoreOutput)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None


class EngineClient:
    """One channel to EngineCore, shared by every request of the gateway."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = aio_channel(address)
        self._stub = engine_pb2_grpc.EngineCoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._health_cache: tuple[float, bool] = (0.0, False)

    async def close(self) -> None:
        await self._channel.close()

    def generate(self, request: EngineCoreRequest) -> EngineStream:
        """Submit `request`; iterate the result for its outputs until one is finished."""
        return EngineStream(self._stub.Generate(to_proto(request, engine_pb2.EngineCoreRequest)))

    async def abort(self, request_ids: Sequence[str]) -> int:
        """Abort requests by id; returns how many the scheduler found."""
        reply = await self._unary(
            self._stub.Abort, engine_pb2.AbortRequest(request_ids=list(request_ids))
        )
        return int(reply.num_aborted)

    async def server_info(self) -> ServerInfo:
        reply = await self._unary(self._stub.GetServerInfo, engine_pb2.GetServerInfoRequest())
        return from_proto(reply, ServerInfo)

    async def stats(self) -> SchedulerStats:
        reply = await self._unary(self._stub.GetStats, engine_pb2.GetStatsRequest())
        return from_proto(reply, SchedulerStats)

    async def healthy(self) -> bool:
        """True while the scheduler reports SERVING (answers cached for HEALTH_CACHE_S)."""
        checked_at, ok = self._health_cache
        now = time.monotonic()
        if now - checked_at < HEALTH_CACHE_S:
            return ok
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            ok = False
        self._health_cache = (now, ok)
        return ok

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
