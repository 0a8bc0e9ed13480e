"""WorkerProtocol over gRPC: the scheduler's handle on a remote `tessera.v1.Worker`."""

from __future__ import annotations

from typing import Any

import grpc

from scheduler_service.errors import WorkerUnavailableError
from scheduler_service.worker_stream import StepStream, StreamStep
from services.convert import from_proto
from services.grpc_utils import check_health, sync_channel
from services.pb import worker_pb2, worker_pb2_grpc
from services.step_types import KVCacheSpec, ModelInfo, ModelRunnerOutput, SchedulerOutput

# Status codes that mean "the worker is not there" (or restarted: FAILED_PRECONDITION is a
# worker without a KV cache), not "the step failed in it".
_TRANSPORT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


class GrpcWorkerClient:
    """Blocking client of one worker rank; implements services.worker_api.WorkerProtocol.

    Steps ride one long-lived ExecuteModelStream call (`submit_model` starts a
    step without waiting; `execute_model` waits for it). Transport failures and
    timeouts raise WorkerUnavailableError; a failure the worker reports (any
    other status, or a failed step on the stream) raises RuntimeError with its
    message.
    """

    def __init__(
        self, address: str, *, step_timeout_s: float = 600.0, rpc_timeout_s: float = 120.0
    ) -> None:
        self.address = address
        self.step_timeout_s = step_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = sync_channel(address)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._stream: StepStream | None = None

    def _call(self, method: Any, request: Any, timeout_s: float) -> Any:
        try:
            return method(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._error_of(exc) from exc

    def _error_of(self, exc: grpc.RpcError) -> Exception:
        code, details = exc.code(), exc.details()
        message = f"worker {self.address}: {code.name}: {details}"
        if code in _TRANSPORT_CODES:
            return WorkerUnavailableError(message)
        return RuntimeError(message)

    def get_model_info(self) -> ModelInfo:
        reply = self._call(
            self._stub.GetModelInfo, worker_pb2.GetModelInfoRequest(), self.rpc_timeout_s
        )
        return from_proto(reply, ModelInfo)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        reply = self._call(
            self._stub.GetKVCacheSpec, worker_pb2.GetKVCacheSpecRequest(), self.rpc_timeout_s
        )
        return from_proto(reply, KVCacheSpec)

    def determine_available_memory(self) -> int:
        reply = self._call(
            self._stub.DetermineAvailableMemory,
            worker_pb2.DetermineAvailableMemoryRequest(),
            self.rpc_timeout_s,
        )
        return int(reply.available_bytes)

    def initialize_cache(self, num_blocks: int) -> int:
        request = worker_pb2.InitializeCacheRequest(num_blocks=num_blocks)
        reply = self._call(self._stub.InitializeCache, request, self.rpc_timeout_s)
        return int(reply.allocated_bytes)

    def submit_model(self, scheduler_output: SchedulerOutput) -> StreamStep:
        """Send a step on the stream (opened on first use, reopened after a failure)."""
        if self._stream is None or self._stream.broken:
            self._stream = StepStream(
                self._stub.ExecuteModelStream, self.address, self.step_timeout_s, self._error_of
            )
        return self._stream.submit(scheduler_output)

    def reset_stream(self) -> None:
        """Close the step stream; the next step opens a new one (after a reconnect)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit_model(scheduler_output).result()

    def shutdown(self) -> None:
        self._call(self._stub.Shutdown, worker_pb2.ShutdownRequest(), self.rpc_timeout_s)

    def is_serving(self, timeout_s: float = 2.0) -> bool:
        """True when the worker's grpc.health.v1 reports SERVING."""
        return check_health(self.address, timeout_s=timeout_s)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._channel.close()
