"""The engine thread: runs EngineCore steps while there is work, sleeps when there is none.

Other threads never touch the engine's state: they post commands (add, abort)
to an inbox guarded by a condition variable, and the engine thread applies them
between steps. So an abort takes effect before the next step is scheduled and
its blocks are free within one step (with async scheduling, a step already sent
to the workers may still carry it once; its result is discarded). Outputs leave
through `publish`, called on the engine thread at most once per step: a step's
updates are held until the next step has been scheduled and are published as
the workers get it, so the event loop streams them while the engine thread
waits on the worker (the GIL is free then) instead of competing with
schedule(). With no next step they are published at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from scheduler_service.engine import WORKER_LOST, EngineCore
from scheduler_service.errors import WorkerLostError
from services.types import EngineCoreOutput, EngineCoreRequest, FinishReason

log = logging.getLogger(__name__)

Publish = Callable[[list[EngineCoreOutput]], None]


@dataclass
class _Abort:
    request_ids: Sequence[str]
    done: Future[int] = field(default_factory=Future)


@dataclass
class _Recover:
    reason: str
    done: Future[bool] = field(default_factory=Future)


_Command = EngineCoreRequest | _Abort | _Recover


class EngineLoop:
    """Owns the engine thread; `submit` / `abort` / `stop` are safe from any thread."""

    def __init__(
        self,
        engine: EngineCore,
        publish: Publish,
        on_health_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self._publish = publish
        self._on_health_change = on_health_change
        self._cond = threading.Condition()
        self._inbox: list[_Command] = []
        self._stopping = False
        self._held: list[EngineCoreOutput] = []  # updates not yet published
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error = ""  # why the loop died, if it did

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.error

    @property
    def healthy(self) -> bool:
        """The loop runs and no worker has been lost."""
        return self.alive and self.engine.healthy

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: EngineCoreRequest) -> None:
        """Queue a request; raises ValueError if it can never fit, RuntimeError if unhealthy."""
        self.engine.validate(request)
        if not self.healthy:
            raise RuntimeError(f"engine is not serving: {self.error or 'a worker was lost'}")
        self._post(request)

    def abort(self, request_ids: Sequence[str]) -> Future[int]:
        """Abort by id before the next step; the future gives how many were found."""
        command = _Abort(list(request_ids))
        self._post(command)
        return command.done

    def recover(self, reason: str) -> Future[bool]:
        """Reconnect to the workers between steps (EngineCore.reconnect): every request
        ends with ERROR, the handshake is repeated; the future tells whether it worked."""
        command = _Recover(reason)
        self._post(command)
        return command.done

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _post(self, command: _Command) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    # ---- the engine thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            while (commands := self._wait_for_work()) is not None:
                self._held += self._apply(commands)
                if self.engine.has_unfinished_requests():
                    outputs = self._step()  # may publish (and replace) self._held
                    self._held += outputs
                if not self.engine.has_unfinished_requests():
                    self._flush()  # no next step to piggyback on
        except Exception as exc:
            log.exception("engine loop died")
            self.error = f"{type(exc).__name__}: {exc}"
            self._flush()
            self._publish(self.engine.scheduler.fail_all(f"engine loop died: {self.error}"))
            self._on_health_change()
        finally:
            self._fail_pending_aborts()

    def _flush(self) -> None:
        """Publish the held updates, if any (engine thread)."""
        if self._held:
            outputs, self._held = self._held, []
            self._publish(outputs)

    def _wait_for_work(self) -> list[_Command] | None:
        """Block until a command arrives or requests are unfinished; None when stopping."""
        with self._cond:
            while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if self._stopping:
                return None
            commands, self._inbox = self._inbox, []
            return commands

    def _apply(self, commands: list[_Command]) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for command in commands:
            if isinstance(command, _Abort):
                aborted = self.engine.abort_requests(command.request_ids)
                outputs += aborted
                command.done.set_result(len(aborted))
            elif isinstance(command, _Recover):
                outputs += self._recover(command)
            else:
                outputs += self._add(command)
        return outputs

    def _add(self, request: EngineCoreRequest) -> list[EngineCoreOutput]:
        if not self.engine.healthy:
            return [_error_output(request.request_id, "engine is not serving: a worker was lost")]
        try:
            self.engine.add_request(request)
        except ValueError as exc:
            return [_error_output(request.request_id, str(exc))]
        return []

    def _recover(self, command: _Recover) -> list[EngineCoreOutput]:
        outputs = self.engine.lose_workers(f"{WORKER_LOST}: {command.reason}")
        try:
            self.engine.reconnect()
        except Exception as exc:  # the worker went away again: still unhealthy, retried later
            log.warning("reconnecting to the workers failed: %s: %s", type(exc).__name__, exc)
        command.done.set_result(self.engine.healthy)
        self._on_health_change()
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        try:
            return self.engine.step(on_scheduled=self._flush)
        except WorkerLostError as exc:
            self._on_health_change()
            return exc.outputs

    def _fail_pending_aborts(self) -> None:
        with self._cond:
            pending, self._inbox = self._inbox, []
        for command in pending:
            if isinstance(command, _Abort) and not command.done.done():
                command.done.set_result(0)
            elif isinstance(command, _Recover) and not command.done.done():
                command.done.set_result(False)


def _error_output(request_id: str, error: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, finish_reason=FinishReason.ERROR, error=error)
