"""Async client of the scheduler's `tessera.v1.EngineCore` gRPC service.

Every request of the gateway rides one multiplexed `GenerateStream` call per
connection (`_Session`): requests and aborts go up, and each engine step comes
back as one message carrying the updates of all requests (and, at most every
0.1 s, the scheduler's figures: `latest_stats`). `generate()`
returns a stream that is also an async context manager: leaving the
`async with` block early (stop string, client disconnect, task cancellation)
sends an abort for that request at once. If the session call breaks, every
request on it fails and the next `generate()` opens a new session. Failures
surface as `ServiceUnavailable` (engine unreachable), `InvalidRequest` or
`EngineError`, mapped from the gRPC status of the call or of the rejection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
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
    return error_from_status(exc.code(), exc.details() or "")


def error_from_status(code: grpc.StatusCode, details: str) -> ApiError:
    """The client-facing error for a gRPC status (a failed call or a session rejection)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServiceUnavailable(f"the engine is unavailable: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ServiceUnavailable(f"the engine is overloaded: {details}")
    return EngineError(f"the engine failed: {details}")


_CODES = {code.value[0]: code for code in grpc.StatusCode}
_Item = EngineCoreOutput | ApiError  # what a stream's queue holds


class EngineStream:
    """The outputs of one request; abort it by leaving `async with` or `cancel()`."""

    def __init__(self, session: _Session, request_id: str) -> None:
        self._session = session
        self.request_id = request_id
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.done = False  # finished, failed or cancelled

    def put(self, item: _Item) -> None:
        """Deliver an update or an error (called by the session's reader)."""
        if isinstance(item, ApiError) or item.finished:
            self.done = True
        self._queue.put_nowait(item)

    def cancel(self) -> None:
        """Abort the request in the scheduler; no-op once it is done."""
        if not self.done:
            self.done = True
            self._session.abort(self.request_id)

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
        while True:
            item = await self._queue.get()
            if isinstance(item, ApiError):
                raise item
            yield item
            if item.finished:
                return


class _Session:
    """One GenerateStream call carrying many requests; broken for good once the call ends."""

    def __init__(
        self, stub: engine_pb2_grpc.EngineCoreStub, on_stats: Callable[[SchedulerStats], None]
    ) -> None:
        self._on_stats = on_stats
        self._outbox: asyncio.Queue[engine_pb2.EngineCoreCommand] = asyncio.Queue()
        self._streams: dict[str, EngineStream] = {}
        self.broken = False
        self._call = stub.GenerateStream(self._commands())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def submit(self, request: EngineCoreRequest) -> EngineStream:
        stream = EngineStream(self, request.request_id)
        self._streams[request.request_id] = stream
        add = to_proto(request, engine_pb2.EngineCoreRequest)
        self._outbox.put_nowait(engine_pb2.EngineCoreCommand(add=add))
        return stream

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and not self.broken:
            abort = engine_pb2.AbortRequest(request_ids=[request_id])
            self._outbox.put_nowait(engine_pb2.EngineCoreCommand(abort=abort))

    def close(self) -> None:
        self._call.cancel()

    async def _commands(self) -> AsyncIterator[engine_pb2.EngineCoreCommand]:
        while True:
            yield await self._outbox.get()

    async def _read(self) -> None:
        error: ApiError = EngineError("the engine closed the session")
        try:
            async for msg in self._call:
                self._route(msg)
        except grpc.aio.AioRpcError as exc:
            error = error_from_rpc(exc)
        except asyncio.CancelledError:
            error = ServiceUnavailable("the engine client was closed")
        finally:
            self.broken = True
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.put(error)

    def _route(self, msg: engine_pb2.EngineCoreOutputs) -> None:
        if msg.HasField("stats"):
            self._on_stats(from_proto(msg.stats, SchedulerStats))
        streams = self._streams
        for rejection in msg.rejections:
            stream = streams.pop(rejection.request_id, None)
            if stream is not None:
                code = _CODES.get(rejection.code, grpc.StatusCode.UNKNOWN)
                stream.put(error_from_status(code, rejection.message))
        for out_msg in msg.outputs:
            stream = streams.get(out_msg.request_id)
            if stream is not None:
                output = from_proto(out_msg, EngineCoreOutput)
                if output.finished:
                    del streams[output.request_id]
                stream.put(output)


class EngineClient:
    """One channel to EngineCore, shared by every request of the gateway."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = aio_channel(address)
        self._stub = engine_pb2_grpc.EngineCoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._health_cache: tuple[float, bool] = (0.0, False)
        self._session: _Session | None = None
        self.latest_stats: SchedulerStats | None = None  # the last figures a session carried
        self.latest_stats_at = 0.0  # monotonic time of latest_stats

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
        await self._channel.close()

    def generate(self, request: EngineCoreRequest) -> EngineStream:
        """Submit `request` on the shared session; iterate the result until an update is finished.

        Raises ServiceUnavailable at once while the scheduler is known to be down (the
        channel failed to connect, or its last health answer was NOT_SERVING); a scheduler
        that is up but not serving refuses the request itself (UNAVAILABLE), so a new
        request never waits for a scheduler that cannot take it."""
        self._check_available()
        if self._session is None or self._session.broken:
            self._session = _Session(self._stub, self._note_stats)
        return self._session.submit(request)

    def _note_stats(self, stats: SchedulerStats) -> None:
        self.latest_stats, self.latest_stats_at = stats, time.monotonic()

    def _check_available(self) -> None:
        state = self._channel.get_state(try_to_connect=True)
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            raise ServiceUnavailable("the engine is unavailable: the scheduler cannot be reached")
        checked_at, ok = self._health_cache
        if not ok and checked_at and time.monotonic() - checked_at < HEALTH_CACHE_S:
            raise ServiceUnavailable("the engine is unavailable: the scheduler is not serving")

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
