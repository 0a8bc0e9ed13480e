"""Worker.ExecuteModelStream through GrpcWorkerClient: steps sent ahead, replies in order,
failed steps, a lost worker and a late reply; against the real Worker gRPC service."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from scheduler_service.errors import WorkerUnavailableError
from scheduler_service.worker_client import GrpcWorkerClient
from services.grpc_utils import GrpcServer
from services.step_types import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from tests.scheduler.fake_worker import FakeWorker
from worker_service.server import build_server

pytestmark = pytest.mark.timeout(60)


@dataclass
class Served:
    """A FakeWorker behind the real Worker service, on its own event-loop thread."""

    worker: FakeWorker
    server: GrpcServer
    loop: asyncio.AbstractEventLoop

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)


@pytest.fixture
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    worker = FakeWorker(step_delay_s=0.02)

    async def start() -> GrpcServer:
        server = build_server("127.0.0.1:0", worker)  # grpc.aio binds to the running loop
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    GrpcWorkerClient(f"127.0.0.1:{server.port}").initialize_cache(16)  # steps need a KV cache
    yield Served(worker, server, loop)
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def prefill(step_id: int = 1) -> SchedulerOutput:
    new = NewRequestData("a", [1, 2, 3], block_ids=[0, 1])
    return SchedulerOutput(step_id, [new], CachedRequestData(), {"a": 3}, 3)


def decode(step_id: int, num_computed: int) -> SchedulerOutput:
    return SchedulerOutput(
        step_id, [], CachedRequestData.of([("a", num_computed, [])]), {"a": 1}, 1
    )


def test_steps_sent_ahead_come_back_in_order(served: Served) -> None:
    client = GrpcWorkerClient(served.address)
    try:
        start = time.perf_counter()
        handles = [client.submit_model(prefill(1))]
        handles += [client.submit_model(decode(i, i + 1)) for i in (2, 3)]  # before any reply
        assert time.perf_counter() - start < 0.02  # nothing waited for the worker
        outputs = [h.result() for h in handles]
        assert [o.step_id for o in outputs] == [1, 2, 3]
        assert [o.sampled_token_ids for o in outputs] == [[4], [5], [6]]
        assert [s.step_id for s in served.worker.steps] == [1, 2, 3]
        assert client.execute_model(decode(4, 5)).sampled_token_ids == [7]  # same call
    finally:
        client.close()


def test_a_failed_step_fails_alone_and_the_stream_goes_on(served: Served) -> None:
    def explode(so: SchedulerOutput) -> None:
        if so.step_id == 2:
            raise RuntimeError("kernel exploded")

    served.worker.raise_on_step = explode
    client = GrpcWorkerClient(served.address)
    try:
        first, failed = client.submit_model(prefill(1)), client.submit_model(decode(2, 3))
        after = client.submit_model(SchedulerOutput(3, finished_req_ids=["a"]))
        assert first.result().sampled_token_ids == [4]
        with pytest.raises(RuntimeError, match="INTERNAL: RuntimeError: kernel exploded"):
            failed.result()
        assert after.result().step_id == 3 and "a" not in served.worker.requests
    finally:
        client.close()


def test_a_lost_worker_fails_every_pending_step_as_unavailable(served: Served) -> None:
    served.worker.step_delay_s = 0.5
    client = GrpcWorkerClient(served.address)
    try:
        handles = [client.submit_model(prefill(1)), client.submit_model(decode(2, 3))]
        served.worker.step_started.wait(5)
        served.stop()
        for handle in handles:
            with pytest.raises(WorkerUnavailableError):
                handle.result()
    finally:
        client.close()


def test_a_reply_later_than_the_step_timeout_is_a_lost_worker(served: Served) -> None:
    served.worker.step_delay_s = 5.0
    client = GrpcWorkerClient(served.address, step_timeout_s=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerUnavailableError, match="CANCELLED"):
            client.execute_model(prefill(1))
        # Behavioural, not a timing budget: the call ended before the worker's reply existed.
        assert time.monotonic() - start < served.worker.step_delay_s
    finally:
        client.close()
