"""The `tessera.v1.Worker` gRPC service around any WorkerProtocol implementation.

Health: NOT_SERVING until InitializeCache has allocated the KV pool, SERVING after
(NOT_SERVING again from the next handshake's DetermineAvailableMemory, which releases
the pool, and after Shutdown). A step before InitializeCache fails with
FAILED_PRECONDITION, which the scheduler reads as "this worker lost its state".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from services.convert import from_proto, to_proto
from services.grpc_utils import GrpcServer, Registration
from services.pb import worker_pb2, worker_pb2_grpc
from services.step_types import SchedulerOutput
from services.tracing import record_timings, step_attributes, step_span
from services.worker_api import WorkerProtocol
from worker_service.model_thread import model_thread

T = TypeVar("T")
log = logging.getLogger(__name__)
NO_CACHE = "the worker has no KV cache yet: InitializeCache must come before ExecuteModelStream"


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Translates protos to domain calls; model work runs on one thread, one step at a time."""

    def __init__(self, worker: WorkerProtocol, on_shutdown: Callable[[], None] | None = None):
        self.worker = worker
        self._executor = model_thread().executor  # the process's (a Worker's own) model thread
        self._on_shutdown = on_shutdown
        self.cache_ready = False  # InitializeCache succeeded (and no Shutdown since)
        self.set_serving: Callable[[bool], Awaitable[None]] | None = None  # set by build_server

    async def _report(self, ready: bool) -> None:
        self.cache_ready = ready
        if self.set_serving is not None:
            await self.set_serving(ready)

    async def _require_cache(self, context: grpc.aio.ServicerContext) -> None:
        if not self.cache_ready:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_CACHE)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return to_proto(await self._run(self.worker.get_model_info), worker_pb2.ModelInfo)

    async def GetKVCacheSpec(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return to_proto(await self._run(self.worker.get_kv_cache_spec), worker_pb2.KVCacheSpec)

    async def DetermineAvailableMemory(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        await self._report(False)  # a handshake starts: the worker releases its old pool
        available = await self._run(self.worker.determine_available_memory)
        return worker_pb2.AvailableMemory(available_bytes=available)

    async def InitializeCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._report(False)  # the old pool is gone while the new one is allocated
        allocated = await self._run(self.worker.initialize_cache, request.num_blocks)
        await self._report(True)
        return worker_pb2.InitializeCacheResponse(allocated_bytes=allocated)

    async def ExecuteModelStream(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for request in request_iterator:
            await self._require_cache(context)
            yield await self._run(self._execute_proto, request)

    def _execute_proto(self, request: worker_pb2.SchedulerOutput) -> worker_pb2.ModelRunnerOutput:
        """One step of the stream, on the model thread; a failed step is a reply with `error`."""
        if request.trace_contexts:  # a step the scheduler sampled for tracing
            with step_span(request.trace_contexts, step_attributes(request)) as span:
                reply = self._execute_step(request)
                record_timings(span, reply)
                return reply
        return self._execute_step(request)

    def _execute_step(self, request: worker_pb2.SchedulerOutput) -> worker_pb2.ModelRunnerOutput:
        try:
            output = self.worker.execute_model(from_proto(request, SchedulerOutput))
        except Exception as exc:
            log.exception("step %d failed", request.step_id)
            return worker_pb2.ModelRunnerOutput(
                step_id=request.step_id, error=f"{type(exc).__name__}: {exc}"
            )
        return to_proto(output, worker_pb2.ModelRunnerOutput)

    async def Shutdown(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._report(False)
        await self._run(self.worker.shutdown)
        if self._on_shutdown is not None:
            self._on_shutdown()
        return worker_pb2.ShutdownResponse()


def build_server(
    address: str, worker: WorkerProtocol, on_shutdown: Callable[[], None] | None = None
) -> GrpcServer:
    """A gRPC server (health, reflection, error statuses) serving `worker` at `address`;
    `on_shutdown` runs after a Shutdown call has released the worker. Call
    `set_serving(False)` before `start()`: InitializeCache turns health SERVING."""
    servicer = WorkerServicer(worker, on_shutdown)
    server = GrpcServer(
        address,
        [Registration("tessera.v1.Worker", worker_pb2_grpc.add_WorkerServicer_to_server, servicer)],
    )
    servicer.set_serving = server.set_serving
    return server
