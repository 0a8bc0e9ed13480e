"""A worker process reports NOT_SERVING until its KV cache exists, refuses steps before that
with FAILED_PRECONDITION, and has an instance id that changes with every start."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from scheduler_service.errors import WorkerUnavailableError
from scheduler_service.worker_client import GrpcWorkerClient
from services.grpc_utils import health_status, sync_channel
from services.pb import worker_pb2, worker_pb2_grpc
from services.step_types import CachedRequestData, NewRequestData, SchedulerOutput
from tests.worker.conftest import spawn_worker, stop_worker
from tests.worker.test_qwen_models import _save_tiny

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("qwen3", tmp_path_factory.mktemp("qwen3-health"))


def _start(tiny_dir: Path) -> tuple[object, str]:
    return spawn_worker("--model", str(tiny_dir), "--dtype", "float32", "--kv-cache-memory", "8MiB")


def _step() -> SchedulerOutput:
    return SchedulerOutput(
        1, [NewRequestData("a", [1, 2, 3], block_ids=[0])], CachedRequestData(), {"a": 3}, 3
    )


def test_not_serving_until_the_kv_cache_exists_and_instance_ids_differ(tiny_dir: Path) -> None:
    ids = []
    for _ in range(2):
        proc, address = _start(tiny_dir)
        client = GrpcWorkerClient(address)
        try:
            assert health_status(address) == NOT_SERVING
            assert health_status(address, "tessera.v1.Worker") == NOT_SERVING
            with sync_channel(address) as channel:  # a raw stream call: the status itself
                stub = worker_pb2_grpc.WorkerStub(channel)
                with pytest.raises(grpc.RpcError) as excinfo:
                    steps = iter([worker_pb2.SchedulerOutput(step_id=1)])
                    list(stub.ExecuteModelStream(steps, timeout=10))
            assert excinfo.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "InitializeCache" in (excinfo.value.details() or "")
            with pytest.raises(WorkerUnavailableError, match="FAILED_PRECONDITION"):
                client.execute_model(_step())  # the stream: the scheduler sees a lost worker
            ids.append(client.get_model_info().instance_id)
            client.initialize_cache(8)
            assert health_status(address) == SERVING
            out = client.execute_model(_step())
            assert out.req_ids == ["a"] and len(out.sampled_token_ids) == 1
        finally:
            client.close()
            assert stop_worker(proc) == 0  # type: ignore[arg-type]
    assert all(len(i) == 32 for i in ids) and ids[0] != ids[1]
