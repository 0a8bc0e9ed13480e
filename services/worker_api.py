"""The contract between the scheduler and a model runner, in domain terms.

The scheduler drives any object with these methods: the in-process
`worker_service.worker.Worker` (offline API), or a gRPC client of the
`tessera.v1.Worker` service. `worker_service.server.WorkerServicer` serves any
implementation over gRPC, so a fake worker can stand behind the real service.
"""

from __future__ import annotations

from typing import Protocol

from services.step_types import KVCacheSpec, ModelInfo, ModelRunnerOutput, SchedulerOutput


class WorkerProtocol(Protocol):
    """One model runner (one rank)."""

    def get_model_info(self) -> ModelInfo:
        """The loaded model: name, max_model_len, vocab size, EOS ids."""
        ...

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """Layout and size of one KV block."""
        ...

    def determine_available_memory(self) -> int:
        """Bytes the KV pool may take after weights and activations."""
        ...

    def initialize_cache(self, num_blocks: int) -> int:
        """Allocate exactly `num_blocks` KV blocks; returns the bytes allocated."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step.

        Contract: for each scheduled request the runner computes tokens
        [num_computed_tokens, num_computed_tokens + num_scheduled) of its token
        list (prompt + outputs). It samples a token only when that range reaches
        the end of the list (otherwise the request is mid-prefill and its
        num_sampled entry is 0), and appends the sampled token to its own copy.
        Requests in finished_req_ids / preempted_req_ids are dropped first; a
        resumed request comes back as new data with its output tokens.
        Failures that belong to one request go to request_errors; a failure of
        the whole step raises.
        """
        ...

    def shutdown(self) -> None:
        """Release the model and the pool."""
        ...
