"""The `tessera.v1.EngineCore` gRPC service around an EngineCore running on its own thread."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from scheduler_service.engine import EngineCore
from scheduler_service.engine_loop import EngineLoop
from scheduler_service.session import Session
from scheduler_service.tracing import RequestSpans
from services.convert import from_proto, to_proto
from services.grpc_utils import GrpcServer, Registration, health_status
from services.log import request_id_var
from services.pb import engine_pb2, engine_pb2_grpc
from services.types import EngineCoreOutput, EngineCoreRequest

log = logging.getLogger(__name__)

# The engine thread waits for each worker step with the GIL released. When the
# reply lands while the event-loop thread is streaming outputs, the engine
# thread waits for the GIL up to the interpreter's switch interval (5 ms by
# default), which is longer than a whole step's overhead. EngineCoreServer
# shortens it for its process; the benchmark (benchmarks.step_overhead_bench)
# shows the effect.
ENGINE_SWITCH_INTERVAL_S = 0.0002
STATS_EVERY_S = 0.1  # stats ride on the sessions' messages at most this often (and on finishes)

# Status codes of GenerateStream rejections, as numbers (RequestRejection.code).
_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_SERVING = health_pb2.HealthCheckResponse.SERVING


class EngineCoreServicer(engine_pb2_grpc.EngineCoreServicer):
    """Streams each request's updates from the engine thread to its caller.

    The engine thread hands each step's outputs to the event loop with one
    `call_soon_threadsafe`; they are routed by request id to the Session of
    their GenerateStream call (one message per step for all of its requests).
    A call that ends before its requests finished (the caller cancelled or went
    away) aborts them, which frees their blocks.
    """

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.loop = EngineLoop(engine, self._publish, self._health_changed)
        self._sinks: dict[str, Session] = {}
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self.on_health_change: Callable[[], None] | None = None  # set by EngineCoreServer
        self.workers_answer = True  # last worker probe result, set by EngineCoreServer
        self.spans: RequestSpans | None = None  # traced requests' spans; None: tracing off
        self._stats_sent_at = 0.0  # monotonic time stats last rode on the sessions

    def start(self) -> None:
        self._aio_loop = asyncio.get_running_loop()
        self.loop.start()

    @property
    def serving(self) -> bool:
        return self.loop.healthy and self.workers_answer

    # ---- from the engine thread -----------------------------------------------

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        if self._aio_loop is not None and not self._aio_loop.is_closed():
            self._aio_loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        if self.spans is not None:
            self.spans.observe(outputs)
        sinks, touched, finished = self._sinks, set(), False
        for output in outputs:
            sink = sinks.get(output.request_id)
            if sink is not None:
                sink.put(output)
                touched.add(sink)
                if output.finished:
                    finished = True
                    del sinks[output.request_id]
        now = time.monotonic()
        if touched and (finished or now - self._stats_sent_at >= STATS_EVERY_S):
            self._stats_sent_at = now
            stats = self._stats_proto()
            for session in touched:
                session.set_stats(stats)

    def _health_changed(self) -> None:
        if self._aio_loop is not None and self.on_health_change is not None:
            self._aio_loop.call_soon_threadsafe(self.on_health_change)

    # ---- RPCs ---------------------------------------------------------------

    async def GenerateStream(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineCoreOutputs]:
        session = Session(asyncio.get_running_loop())
        reader = asyncio.create_task(self._read_commands(request_iterator, session))
        try:
            while (msg := await session.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            self._abort_in_session(session, list(session.live))  # the call broke: free them all

    async def _read_commands(self, commands: AsyncIterator[Any], session: Session) -> None:
        try:
            async for command in commands:
                if command.WhichOneof("command") == "add":
                    self._add_to_session(command.add, session)
                else:
                    self._abort_in_session(session, command.abort.request_ids)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the call ended; GenerateStream's cleanup aborts what is left
        finally:
            session.input_done = True
            session.wake()

    def _add_to_session(self, msg: engine_pb2.EngineCoreRequest, session: Session) -> None:
        """Queue one request of a session, or queue its rejection with a gRPC status code."""
        request_id = msg.request_id
        request_id_var.set(request_id)  # this reader task's log lines name the request
        try:
            req = request_from_proto(msg)
            if req.request_id in self._sinks:
                return session.reject(request_id, _ALREADY_EXISTS, "request_id already in flight")
            if not self.serving:
                return session.reject(request_id, _UNAVAILABLE, "engine is not serving")
            self._submit(req)  # outputs are dispatched on this thread, after this returns
        except ValueError as exc:
            return session.reject(request_id, _INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:
            return session.reject(request_id, _UNAVAILABLE, str(exc))
        except Exception as exc:  # a bug: answer the caller rather than leave it waiting
            log.exception("GenerateStream could not add %r", request_id)
            return session.reject(request_id, _INTERNAL, f"{type(exc).__name__}: {exc}")
        self._sinks[request_id] = session
        session.live.add(request_id)

    def _submit(self, req: EngineCoreRequest) -> None:
        """`loop.submit`, tracking a traced request first (the engine may schedule it at once)."""
        if self.spans is None:
            return self.loop.submit(req)
        self.spans.add(req)
        try:
            self.loop.submit(req)
        except BaseException:
            self.spans.discard(req.request_id)
            raise

    def _abort_in_session(self, session: Session, request_ids: Sequence[str]) -> None:
        """Abort the session's requests among `request_ids`; their updates stop at once."""
        ids = [i for i in request_ids if i in session.live]
        for request_id in ids:
            session.live.discard(request_id)
            if self._sinks.get(request_id) is session:
                del self._sinks[request_id]
        if ids:
            self.loop.abort(ids)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        num_aborted = await asyncio.wrap_future(self.loop.abort(list(request.request_ids)))
        return engine_pb2.AbortResponse(num_aborted=num_aborted)

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return to_proto(self.engine.server_info(), engine_pb2.ServerInfo)

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return self._stats_proto()

    def _stats_proto(self) -> engine_pb2.SchedulerStats:
        stats = self.engine.stats()
        stats.healthy = self.serving
        return to_proto(stats, engine_pb2.SchedulerStats)


def request_from_proto(msg: engine_pb2.EngineCoreRequest) -> EngineCoreRequest:
    """`from_proto`, plus a non-empty request_id."""
    req = from_proto(msg, EngineCoreRequest)
    if not req.request_id:
        raise ValueError("request_id must not be empty")
    return req


class EngineCoreServer:
    """The EngineCore gRPC server: servicer, engine thread, health and worker probes.

    Health is SERVING while the engine thread runs, no worker was lost and every
    worker reports SERVING (probed every `probe_interval_s`). A lost or restarted
    worker ends every request with ERROR; once the workers answer again the
    scheduler repeats the KV handshake and serves again (see `_probe_workers`).
    """

    def __init__(
        self,
        address: str,
        engine: EngineCore,
        worker_addresses: Sequence[str] = (),
        probe_interval_s: float = 2.0,
        switch_interval_s: float | None = ENGINE_SWITCH_INTERVAL_S,
    ) -> None:
        self.servicer = EngineCoreServicer(engine)
        self.servicer.on_health_change = self._schedule_health_refresh
        self.grpc = GrpcServer(
            address,
            [
                Registration(
                    "tessera.v1.EngineCore",
                    engine_pb2_grpc.add_EngineCoreServicer_to_server,
                    self.servicer,
                )
            ],
        )
        self.port = self.grpc.port
        self.worker_addresses = list(worker_addresses)
        self.probe_interval_s = probe_interval_s
        self.switch_interval_s = switch_interval_s  # None: leave the process's setting alone
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Start the engine thread and the server; sets the process's GIL switch interval."""
        if self.switch_interval_s is not None:
            sys.setswitchinterval(self.switch_interval_s)
        self.servicer.start()
        await self.grpc.start()
        await self.refresh_health()
        if self.worker_addresses:
            self._spawn(self._probe_workers())

    async def stop(self, grace_s: float = 5.0) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.grpc.stop(grace_s)
        await asyncio.to_thread(self.servicer.loop.stop)
        self.servicer.engine.shutdown()

    async def wait(self) -> None:
        await self.grpc.wait()

    @property
    def serving(self) -> bool:
        return self.servicer.serving

    async def refresh_health(self) -> None:
        await self.grpc.set_serving(self.serving)

    def _schedule_health_refresh(self) -> None:
        self._spawn(self.refresh_health())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe_workers(self) -> None:
        """Every `probe_interval_s`: read each worker's health; once every worker answers
        again after one was lost (or one answers NOT_SERVING: it restarted and has no KV
        cache), reconnect (EngineCore.reconnect) and serve again."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            statuses = await asyncio.gather(
                *(asyncio.to_thread(health_status, a, "", 1.0) for a in self.worker_addresses)
            )
            ready = all(s == _SERVING for s in statuses)
            if ready != self.servicer.workers_answer:
                log.warning("workers %s", "answer again" if ready else "are down or restarted")
            self.servicer.workers_answer = ready
            await self.refresh_health()
            up = all(s is not None for s in statuses)
            loop = self.servicer.loop
            if up and loop.alive and not (ready and loop.healthy):
                await self._recover(statuses)

    async def _recover(self, statuses: Sequence[int | None]) -> None:
        """Reconnect on the engine thread; health turns SERVING again when it worked."""
        restarted = [
            a for a, s in zip(self.worker_addresses, statuses, strict=True) if s != _SERVING
        ]
        reason = f"worker {', '.join(restarted)} restarted" if restarted else "a worker was lost"
        log.warning("%s: ending every request and repeating the KV handshake", reason)
        ok = await asyncio.wrap_future(self.servicer.loop.recover(reason))
        self.servicer.workers_answer = ok
        await self.refresh_health()
        if ok:
            log.warning("serving again after %s", reason)
