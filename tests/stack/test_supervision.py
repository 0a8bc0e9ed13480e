"""`tessera serve` supervises its services: a killed gateway comes back by itself; the
internal token stays out of argv; the launcher names the served model; no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.stack import start_stack

pytestmark = pytest.mark.slow
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def _answers(base_url: str) -> bool:
    try:
        return httpx.post(f"{base_url}/v1/chat/completions", json=CHAT, timeout=10).is_success
    except httpx.HTTPError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return not state.stdout.strip().startswith("Z")


def test_killed_gateway_comes_back_and_stop_leaves_no_orphans() -> None:
    stack = start_stack()
    try:
        assert stack.wait_for_line("tessera: serving SmolLM2-135M-Instruct at", 10), stack.output()
        pids = stack.service_pids()
        assert set(pids) == {"worker_service", "scheduler_service", "gateway"}
        for pid in pids.values():  # the token travels by environment, not argv
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert stack.internal_token.encode() not in argv
        assert _answers(stack.base_url)

        os.kill(pids["gateway"], signal.SIGKILL)
        killed_at = time.monotonic()
        while not _answers(stack.base_url):
            assert time.monotonic() - killed_at < 30, stack.output()[-3000:]
            time.sleep(0.5)
        assert stack.wait_for_line("tessera: gateway died (exit code -9); restarting", 1)
        new_pids = stack.service_pids()
        assert new_pids["gateway"] != pids["gateway"]
        assert new_pids["scheduler_service"] == pids["scheduler_service"]
    finally:
        code = stack.stop()
    assert code == 0, stack.output()[-3000:]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in new_pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in new_pids.values())


def test_a_hung_scheduler_is_killed_and_restarted() -> None:
    """SIGSTOP (a hang: the process lives, its health never answers) is caught by the
    launcher's liveness probe, which SIGKILLs it; the supervisor restarts it."""
    stack = start_stack()
    try:
        assert _answers(stack.base_url)
        pids = stack.service_pids()
        os.kill(pids["scheduler_service"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        killed = "tessera: scheduler stopped answering its health probe; killed it"
        assert stack.wait_for_line(killed, 60), stack.output()[-3000:]
        assert stack.wait_for_line("tessera: scheduler died (exit code -9); restarting", 5)
        while not _answers(stack.base_url):
            assert time.monotonic() - stopped_at < 90, stack.output()[-3000:]
            time.sleep(0.5)
        new_pids = stack.service_pids()
        assert new_pids["scheduler_service"] != pids["scheduler_service"]
        assert new_pids["worker_service"] == pids["worker_service"]
        print(f"hung scheduler: answering again {time.monotonic() - stopped_at:.1f}s after SIGSTOP")
    finally:
        code = stack.stop()
    assert code == 0, stack.output()[-3000:]
