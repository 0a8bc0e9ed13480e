"""`python -m scheduler_service` as a process, against a fake worker process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from services.convert import to_proto
from services.grpc_utils import check_health, sync_channel
from services.pb import engine_pb2, engine_pb2_grpc
from services.types import EngineCoreRequest, SamplingParams
from tests.conftest import free_port
from tests.engine_session import generate_sync


def test_help_lists_the_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "scheduler_service", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    flags = ("--worker", "--port", "--max-num-seqs", "--policy", "--no-prefix-caching")
    for flag in (*flags, "--no-async-scheduling"):
        assert flag in result.stdout


def wait_until_serving(address: str, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check_health(address, timeout_s=0.5):
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{address} never reported SERVING"
        time.sleep(0.1)


@pytest.mark.slow
def test_scheduler_process_serves_generate_and_stops_on_sigterm() -> None:
    worker_port, port = free_port(), free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.scheduler.fake_worker_server", "--port", str(worker_port)]
    )
    scheduler = subprocess.Popen(
        [
            sys.executable, "-m", "scheduler_service",
            "--worker", f"127.0.0.1:{worker_port}",
            "--port", str(port), "--num-blocks", "32", "--log-level", "WARNING",
        ]
    )  # fmt: skip
    try:
        wait_until_serving(f"127.0.0.1:{port}", scheduler)
        with sync_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            info = stub.GetServerInfo(engine_pb2.GetServerInfoRequest(), timeout=5)
            assert (info.num_blocks, info.block_size, info.model_name) == (32, 4, "fake")
            request = EngineCoreRequest("cli", [10, 11], SamplingParams(max_tokens=3))
            outputs = generate_sync(stub, to_proto(request, engine_pb2.EngineCoreRequest), 10)
            assert [t for o in outputs for t in o.new_token_ids] == [12, 13, 14]
            assert outputs[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(timeout=20) == 0
    finally:
        for proc in (scheduler, worker):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
