"""`tessera serve`: worker, scheduler and gateway as three local processes on loopback.

Started in dependency order, each gated on its health; their logs are streamed
with a service prefix. A service that dies on its own is logged and restarted
after a backoff that doubles with each quick death (1 s up to 30 s) and resets once
it stayed up a minute. A service that hangs is treated as dead: once it has answered its
health probe, LIVENESS_MISSES probes in a row without an answer get it SIGKILLed. SIGINT/SIGTERM drains the gateway, then stops the scheduler
and the worker. Children die with the launcher even when it is SIGKILLed (Linux).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from services.grpc_utils import check_health, health_status
from services.healthcheck import http_answers, http_healthy
from services.log import request_stack_dumps

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # up this long, a service's next death restarts it after BACKOFF_FIRST_S
LIVENESS_EVERY_S = 5.0  # how often a running service's liveness probe is asked
LIVENESS_MISSES = 3  # unanswered probes in a row that mean hung
LIVENESS_TIMEOUT_S = 5.0  # how long one liveness probe waits for an answer
_PR_SET_PDEATHSIG = 1


@functools.cache
def _prctl() -> Callable[..., int]:
    return ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent_fn() -> Callable[[], None] | None:
    """A pre-exec hook that SIGTERMs the child when the launcher dies (Linux only). The
    libc lookup happens here, in the parent: the forked child only makes the call."""
    if sys.platform != "linux":
        return None
    prctl = _prctl()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return hook


@dataclass
class Service:
    """One child process, how to tell it is ready, and its restart state."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    up: Callable[[], bool]  # liveness: the process answers at all (healthy or not)
    env: Mapping[str, str] = field(default_factory=dict)  # added to the launcher's environment
    listens: tuple[tuple[str, int], ...] = ()  # (host, port) it binds: checked free before start
    process: subprocess.Popen[str] | None = None
    started_at: float = 0.0
    backoff_s: float = BACKOFF_FIRST_S
    restart_at: float | None = None  # when a dead service is due to start again
    answered: bool = False  # its liveness probe has answered since this start
    misses: int = 0  # liveness probes unanswered in a row
    log_thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, **self.env},
            start_new_session=True,  # our signals reach it only through us
            preexec_fn=_die_with_parent_fn(),
        )
        self.started_at = time.monotonic()
        self.restart_at = None
        self.answered, self.misses = False, 0
        self.log_thread = threading.Thread(target=self._pump, daemon=True)
        self.log_thread.start()

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            sys.stdout.write(f"[{self.name}] {line}")
            sys.stdout.flush()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def dump_stacks(self, settle_s: float = 1.0) -> None:
        """Have the service print its threads' Python stacks (services.log.enable_stack_dumps)
        into its log."""
        if self.process is not None and self.alive():
            request_stack_dumps([self.process.pid], settle_s)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if self.process is not None:
            terminate(self.process, timeout_s)

    def check_liveness(self) -> bool:
        """Ask the liveness probe; SIGKILL the process (the supervisor then restarts it) once it
        has answered before and now missed LIVENESS_MISSES probes in a row. True if killed."""
        process = self.process
        if process is None or process.poll() is not None:
            return False
        if self.up():
            self.answered, self.misses = True, 0
            return False
        if self.answered:  # still starting up (loading a model) is not hanging
            self.misses += 1
        if self.misses < LIVENESS_MISSES or process is not self.process:
            return False
        process.kill()
        return True

    def schedule_restart(self, now: float) -> float:
        """Note a death at `now`; returns the delay before the restart."""
        if now - self.started_at >= STABLE_AFTER_S:
            self.backoff_s = BACKOFF_FIRST_S
        delay = self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)
        self.restart_at = now + delay
        return delay


def terminate(process: subprocess.Popen[Any], timeout_s: float) -> None:
    """SIGTERM a running process, then SIGKILL it after `timeout_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def port_free(host: str, port: int) -> bool:
    """Whether a TCP server could listen on host:port now (port 0 always can). Bound without
    SO_REUSEPORT, as our servers are, so a server that set it still counts as there."""
    if port == 0:
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not in use
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness probe: GET url answers 200."""
    return lambda: http_healthy(url, timeout_s=2)


def grpc_ok(address: str) -> Callable[[], bool]:
    """A readiness probe: grpc.health.v1 reports SERVING."""
    return lambda: check_health(address)


def grpc_up(address: str, timeout_s: float = 2.0) -> Callable[[], bool]:
    """A readiness probe: grpc.health.v1 answers, SERVING or not (a worker is NOT_SERVING
    until the scheduler's KV handshake, which needs the worker up first)."""
    return lambda: health_status(address, timeout_s=timeout_s) is not None


def http_up(url: str) -> Callable[[], bool]:
    """A liveness probe: GET url answers within LIVENESS_TIMEOUT_S, with any status."""
    return lambda: http_answers(url, LIVENESS_TIMEOUT_S)


class Launcher:
    """Starts services in order, restarts those that die, and stops them in reverse order."""

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
                    return 0 if self._stop.is_set() else 1  # a signal mid-start is a clean stop
            on_ready()
            threading.Thread(target=self._watch_liveness, daemon=True).start()
            while not self._stop.wait(0.5):
                self._supervise()
            return 0
        finally:
            self.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self, service: Service) -> bool:
        taken = [f"{host}:{port}" for host, port in service.listens if not port_free(host, port)]
        if taken:  # another program's server there would answer our probes in our service's place
            _say(f"{service.name} cannot listen on {', '.join(taken)}: already in use")
            return False
        service.start()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if not service.alive():
                print(f"tessera: {service.name} exited during start-up", file=sys.stderr)
                return False
            if service.ready():
                service.answered = True  # a hang from now on counts
                return True
            time.sleep(0.25)
        if not self._stop.is_set():
            _say(f"{service.name} was not ready in {self.start_timeout_s:.0f}s; its stacks:")
            service.dump_stacks()
        return False

    def _supervise(self) -> None:
        """Log each death, and restart dead services once their backoff has passed."""
        now = time.monotonic()
        for service in self.services:
            if service.process is None or service.alive():
                continue
            if service.restart_at is None:
                delay = service.schedule_restart(now)
                code = service.process.returncode
                _say(f"{service.name} died (exit code {code}); restarting in {delay:.0f}s")
            elif now >= service.restart_at and not self._stop.is_set():
                _say(f"restarting {service.name}")
                service.start()

    def _watch_liveness(self) -> None:
        """Every LIVENESS_EVERY_S, SIGKILL the services that hang (answered once, then stopped
        answering); `_supervise` logs the death and restarts them."""
        while not self._stop.wait(LIVENESS_EVERY_S):
            for service in self.services:
                if service.check_liveness():
                    _say(f"{service.name} stopped answering its health probe; killed it")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Gateway first (it drains in-flight streams), then scheduler, then worker."""
        for i, service in enumerate(reversed(self.services)):
            service.stop(self.drain_timeout_s + 5 if i == 0 else 10)


def _say(message: str) -> None:
    print(f"tessera: {message}", file=sys.stderr, flush=True)
