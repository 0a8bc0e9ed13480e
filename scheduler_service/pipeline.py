"""Steps started on the workers without waiting for them (async scheduling).

`StepSubmitter.submit` hands a SchedulerOutput to every worker and returns at
once with an `InFlightStep`; `InFlightStep.result()` waits for rank 0's output
(and the other ranks'). A worker that can start a step itself (the gRPC client,
`submit_model` on its ExecuteModelStream) does so; any other WorkerProtocol
runs `execute_model` on its own single thread, so each worker still runs its
steps one at a time, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from services.step_types import ModelRunnerOutput, SchedulerOutput
from services.worker_api import WorkerProtocol


class StepHandle(Protocol):
    """A step started on one worker."""

    def result(self) -> ModelRunnerOutput:
        """Wait for the step's output (raises what the step raised)."""
        ...


@dataclass(slots=True)
class InFlightStep:
    """A scheduled step whose outputs are not committed yet."""

    scheduler_output: SchedulerOutput
    handles: list[StepHandle]  # one per worker, rank 0 first
    start: float  # perf_counter() when it was scheduled

    def result(self) -> ModelRunnerOutput:
        """Rank 0's output, once every rank answered."""
        outputs = [h.result() for h in self.handles]
        return outputs[0]


class StepSubmitter:
    """Starts steps on every worker without waiting."""

    def __init__(self, workers: Sequence[WorkerProtocol]) -> None:
        self.workers = list(workers)
        self._threads = [
            None if hasattr(w, "submit_model") else ThreadPoolExecutor(1, thread_name_prefix="step")
            for w in self.workers
        ]

    def submit(self, scheduler_output: SchedulerOutput, start: float) -> InFlightStep:
        handles: list[StepHandle] = []
        for worker, thread in zip(self.workers, self._threads, strict=True):
            if thread is None:
                handles.append(worker.submit_model(scheduler_output))  # type: ignore[attr-defined]
            else:
                handles.append(thread.submit(worker.execute_model, scheduler_output))
        return InFlightStep(scheduler_output, handles, start)

    def shutdown(self) -> None:
        for thread in self._threads:
            if thread is not None:
                thread.shutdown(wait=False)


def has_work(scheduler_output: SchedulerOutput) -> bool:
    """Whether a step is worth sending: tokens to compute, or requests for workers to drop."""
    so = scheduler_output
    return bool(so.num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids)
