"""The long-lived `Worker.ExecuteModelStream` call of one worker client.

Steps go up as they are scheduled and replies come back in the same order, so
the scheduler can send step n+1 before step n's reply (async scheduling) and
no step pays for a new call. `submit` queues a step and returns a handle;
`handle.result()` reads replies in order until its own arrives. Everything
runs on the caller's thread (the engine thread) except gRPC's own sender and
a watchdog that cancels the call when a reply is `step_timeout_s` late.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from scheduler_service.errors import WorkerUnavailableError
from services.convert import from_proto, to_proto
from services.pb import worker_pb2
from services.step_types import ModelRunnerOutput, SchedulerOutput

ErrorOf = Callable[[grpc.RpcError], Exception]  # how a failed call becomes an exception


class StreamStep:
    """One step sent on the stream; `result()` waits for its reply."""

    __slots__ = ("_error", "_output", "_stream")

    def __init__(self, stream: StepStream) -> None:
        self._stream = stream
        self._output: ModelRunnerOutput | None = None
        self._error: Exception | None = None

    def result(self) -> ModelRunnerOutput:
        while self._output is None and self._error is None:
            self._stream.read_one()
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output


class StepStream:
    """One open ExecuteModelStream call; broken for good after any transport failure."""

    def __init__(self, method: Any, address: str, step_timeout_s: float, error_of: ErrorOf) -> None:
        self._address = address
        self._step_timeout_s = step_timeout_s
        self._error_of = error_of
        self._requests: queue.SimpleQueue[worker_pb2.SchedulerOutput | None] = queue.SimpleQueue()
        self._call = method(iter(self._requests.get, None))
        self._replies: Iterator[worker_pb2.ModelRunnerOutput] = iter(self._call)
        self._pending: deque[StreamStep] = deque()
        self._deadline = 0.0  # when the reply waited for is late; 0: not waiting
        self.broken = False
        self._watchdog = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._watchdog.start()

    def submit(self, scheduler_output: SchedulerOutput) -> StreamStep:
        step = StreamStep(self)
        self._pending.append(step)
        self._requests.put(to_proto(scheduler_output, worker_pb2.SchedulerOutput))
        return step

    def read_one(self) -> None:
        """Read the next reply and hand it to the oldest pending step."""
        step = self._pending.popleft()
        self._deadline = time.monotonic() + self._step_timeout_s
        try:
            reply = next(self._replies)
        except grpc.RpcError as exc:
            return self._fail(step, self._error_of(exc))
        except StopIteration:
            return self._fail(step, self._error_of_closed())
        finally:
            self._deadline = 0.0
        if reply.error:
            step._error = RuntimeError(f"worker {self._address}: INTERNAL: {reply.error}")
        else:
            step._output = from_proto(reply, ModelRunnerOutput)

    def close(self) -> None:
        self.broken = True
        self._requests.put(None)
        self._call.cancel()

    def _fail(self, step: StreamStep, error: Exception) -> None:
        """The call broke: this step and every later one fail with `error`."""
        self.close()
        step._error = error
        while self._pending:
            self._pending.popleft()._error = error

    def _error_of_closed(self) -> Exception:
        return WorkerUnavailableError(f"worker {self._address}: the step stream closed")

    def _watch(self) -> None:
        while not self.broken:
            time.sleep(min(1.0, self._step_timeout_s))
            deadline = self._deadline
            if deadline and time.monotonic() > deadline:
                self._call.cancel()  # read_one sees CANCELLED: the worker is unavailable
                return
