"""`tessera serve`: worker, scheduler and gateway as three local processes on loopback.

Started in dependency order, each gated on its health; their logs are streamed
with a service prefix. SIGINT/SIGTERM drains the gateway, then stops the
scheduler and the worker. A service that dies on its own is reported by name;
the others keep running so clients see 503s and errors rather than hangs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from services.grpc_utils import check_health
from services.healthcheck import http_healthy


@dataclass
class Service:
    """One child process and how to tell it is ready."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    process: subprocess.Popen[str] | None = None
    reported_exit: bool = False
    log_thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # our signals reach it only through us
        )
        self.log_thread = threading.Thread(target=self._pump, daemon=True)
        self.log_thread.start()

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            sys.stdout.write(f"[{self.name}] {line}")
            sys.stdout.flush()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if not self.alive():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness probe: GET url answers 200."""
    return lambda: http_healthy(url, timeout_s=2)


def grpc_ok(address: str) -> Callable[[], bool]:
    """A readiness probe: grpc.health.v1 reports SERVING."""
    return lambda: check_health(address)


class Launcher:
    """Starts services in order, watches them, and stops them in reverse order."""

    def __init__(self, services: list[Service], start_timeout_s: float, drain_timeout_s: float):
        self.services = services
        self.start_timeout_s = start_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._stop = threading.Event()

    def run(self, on_ready: Callable[[], None]) -> int:
        """Serve until a signal arrives; returns the exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for service in self.services:
                if not self._start(service):
                    return 1
            on_ready()
            while not self._stop.wait(0.5):
                self._report_deaths()
            return 0
        finally:
            self.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self, service: Service) -> bool:
        service.start()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if not service.alive():
                print(f"tessera: {service.name} exited during start-up", file=sys.stderr)
                return False
            if service.ready():
                return True
            time.sleep(0.25)
        if not self._stop.is_set():
            print(
                f"tessera: {service.name} was not ready in {self.start_timeout_s:.0f}s",
                file=sys.stderr,
            )
        return False

    def _report_deaths(self) -> None:
        for service in self.services:
            if service.process is not None and not service.alive() and not service.reported_exit:
                service.reported_exit = True
                code = service.process.returncode
                print(
                    f"tessera: {service.name} died (exit code {code})", file=sys.stderr, flush=True
                )

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Gateway first (it drains in-flight streams), then scheduler, then worker."""
        for i, service in enumerate(reversed(self.services)):
            service.stop(self.drain_timeout_s + 5 if i == 0 else 10)
