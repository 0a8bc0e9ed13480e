"""Run `tessera serve` as a real process tree on free loopback ports, for end-to-end tests
and benchmarks (no test-only imports, so it works from an installed wheel)."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.soak import free_port
from services.config import SecurityConfig
from services.log import request_stack_dumps
from services.security import TOKEN_ENV

REPO = Path(__file__).resolve().parents[1]
INTERNAL_TOKEN = "stack-test-internal-token"  # given to `tessera serve` by TESSERA_INTERNAL_TOKEN


@dataclass
class Stack:
    """A running `tessera serve` and its addresses."""

    process: subprocess.Popen[str]
    port: int
    grpc_port: int
    scheduler_port: int
    worker_port: int
    lines: list[str] = field(default_factory=list)
    internal_token: str = INTERNAL_TOKEN

    @property
    def internal(self) -> SecurityConfig:
        """Credentials of the internal services (EngineCore, Worker)."""
        return SecurityConfig(token=self.internal_token)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    @property
    def worker_address(self) -> str:
        return f"127.0.0.1:{self.worker_port}"

    @property
    def gateway_grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.1)
        return False

    def service_pids(self) -> dict[str, int]:
        """pid of each child service, from the process table (children of the launcher)."""
        out = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(self.process.pid)],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        pids = {}
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            for name in ("worker_service", "scheduler_service", "gateway"):
                if f"-m {name}" in args:
                    pids[name] = int(pid)
        return pids

    def hang_report(self, settle_s: float = 2.0) -> str:
        """The output so far, after asking each live service for its threads' Python stacks
        (SIGUSR1: services.log.enable_stack_dumps)."""
        request_stack_dumps(self.service_pids().values(), settle_s)
        return self.output()[-30000:]

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_stack(
    *extra: str, timeout_s: float = 300, python: str = sys.executable, cwd: Path = REPO
) -> Stack:
    """Start `tessera serve` with the default model and wait until /health is 200 (`python`:
    the interpreter whose install runs it; `cwd`: outside the repository to run a wheel's).
    A start that fails (a hang, with every service's Python stacks, or a crash) is reported
    on stderr and tried once more, as CI has seen rare start-up faults inside gRPC's poller;
    a second failure raises RuntimeError with its report."""
    for attempt in (1, 2):
        stack = _launch(extra, python, cwd)
        if wait_healthy(stack.process, stack.base_url, timeout_s):
            return stack
        report = (
            f"tessera serve did not become healthy in {timeout_s:.0f} s:\n{stack.hang_report()}"
        )
        stack.stop()
        if attempt == 1:
            print(f"{report}\n(starting it once more)", file=sys.stderr, flush=True)
    raise RuntimeError(report)


def _launch(extra: tuple[str, ...], python: str, cwd: Path) -> Stack:
    ports = [free_port() for _ in range(4)]
    argv = [
        python, "-m", "tessera", "serve",
        "--port", str(ports[0]), "--grpc-port", str(ports[1]),
        "--scheduler-port", str(ports[2]), "--worker-port", str(ports[3]),
        "--kv-cache-memory", "1GiB", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: INTERNAL_TOKEN}
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    stack = Stack(process, ports[0], ports[1], ports[2], ports[3])
    threading.Thread(target=_pump, args=(stack,), daemon=True).start()
    return stack


def _pump(stack: Stack) -> None:
    assert stack.process.stdout is not None
    for line in stack.process.stdout:
        stack.lines.append(line)


def wait_healthy(
    process: subprocess.Popen[Any], base_url: str, timeout_s: float, interval_s: float = 0.5
) -> bool:
    """Whether `base_url`/health answers 200 within `timeout_s` while `process` lives."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def tree_sockets(pid: int) -> list[tuple[str, str, str]]:
    """(process, local address, remote address or LISTEN) of every inet socket of `pid` and
    its descendants."""
    root = psutil.Process(pid)
    sockets = []
    for proc in [root, *root.children(recursive=True)]:
        name = " ".join(proc.cmdline()[1:4])
        sockets += [
            (name, f"{c.laddr.ip}:{c.laddr.port}", "LISTEN" if not c.raddr else c.raddr.ip)
            for c in proc.net_connections(kind="inet")
            if c.laddr
        ]
    return sockets


def beyond_loopback(sockets: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The sockets of `tree_sockets` that listen on or talk to a non-loopback address."""
    return [
        s
        for s in sockets
        if not _is_loopback(s[1].rsplit(":", 1)[0]) or (s[2] != "LISTEN" and not _is_loopback(s[2]))
    ]
