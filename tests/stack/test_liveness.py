"""The launcher's liveness rule, on a real child process: a service that has not answered yet
is starting (never killed); once it has answered, LIVENESS_MISSES misses in a row kill it.
And its start-up checks: a service not ready in time, a port another program holds."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from tessera.launcher import LIVENESS_MISSES, Launcher, Service, port_free
from tests.conftest import free_port


def test_misses_count_only_after_a_first_answer_and_kill_after_enough() -> None:
    answers = iter([False] * 5 + [True] + [False] * (LIVENESS_MISSES - 1) + [True] + [False] * 9)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    service = Service("sleeper", sleeper, ready=lambda: True, up=lambda: next(answers))
    service.start()
    try:
        assert service.process is not None
        outcomes = [service.check_liveness() for _ in range(5)]  # starting up: never killed
        assert outcomes == [False] * 5 and service.misses == 0
        assert not service.check_liveness() and service.answered
        outcomes = [service.check_liveness() for _ in range(LIVENESS_MISSES - 1)]
        assert not any(outcomes) and service.alive()  # one short of the limit
        assert not service.check_liveness() and service.misses == 0  # an answer resets
        outcomes = [service.check_liveness() for _ in range(LIVENESS_MISSES)]
        assert outcomes == [False] * (LIVENESS_MISSES - 1) + [True]
        assert service.process.wait(5) == -9
        assert not service.check_liveness()  # a dead process is the supervisor's business
    finally:
        service.stop(5)


def test_a_service_not_ready_in_time_prints_its_stacks_and_the_start_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hung = (
        "import time\nfrom services.log import setup_logging\nsetup_logging('hung')\n"
        "def waiting_for_godot():\n    time.sleep(60)\nwaiting_for_godot()\n"
    )
    service = Service("hung", [sys.executable, "-c", hung], ready=lambda: False, up=lambda: True)
    launcher = Launcher([service], start_timeout_s=3, drain_timeout_s=1)
    assert launcher.run(on_ready=lambda: None) == 1
    out = capsys.readouterr()
    assert "hung was not ready in 3s" in out.err
    assert "[hung]" in out.out and "waiting_for_godot" in out.out


def test_a_port_another_server_holds_stops_serve_before_any_service_starts() -> None:
    """A foreign gRPC server on the worker's port (SO_REUSEPORT on, grpc's default) would answer
    the launcher's probes in the worker's place; serve refuses to start instead."""
    foreign = grpc.server(futures.ThreadPoolExecutor(1))
    port = foreign.add_insecure_port("127.0.0.1:0")
    foreign.start()
    try:
        assert not port_free("127.0.0.1", port) and port_free("127.0.0.1", free_port())
        argv = ["--worker-port", str(port), "--scheduler-port", str(free_port()), "--port", "0"]
        run = subprocess.run(
            [sys.executable, "-m", "tessera", "serve", *argv, "--grpc-port", "0"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        foreign.stop(None)
    assert run.returncode == 1
    assert f"worker cannot listen on 127.0.0.1:{port}: already in use" in run.stderr
    assert "[worker]" not in run.stdout and "[scheduler]" not in run.stdout  # none started
