"""The EngineCore: the scheduler driving its workers, in process, without gRPC.

Used by the gRPC service (scheduler_service.service) and by the offline API.
Not thread-safe: one thread calls add_request / abort_requests / step; only
`validate` (which reads immutable figures) may be called from elsewhere.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from scheduler_service.errors import WorkerLostError, WorkerUnavailableError
from scheduler_service.kv_cache_manager import cdiv
from scheduler_service.pipeline import InFlightStep, StepSubmitter, has_work
from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler
from services.config import CacheConfig, SchedulerConfig
from services.step_types import (
    KVCacheSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    ServerInfo,
)
from services.types import EngineCoreOutput, EngineCoreRequest, MultiModalInput
from services.worker_api import WorkerProtocol

log = logging.getLogger(__name__)

VERSION = "0.1.0"
WORKER_LOST = "the worker was lost/restarted"  # the error of requests a lost worker ends
PROTOCOL_VERSION = "tessera.v1"


class EngineCore:
    """schedule -> execute on every worker -> update, plus the KV capacity handshake."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        workers: Sequence[WorkerProtocol],
    ) -> None:
        if not workers:
            raise ValueError("the engine needs at least one worker")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.workers = list(workers)
        self._handshake()
        self._pool = ThreadPoolExecutor(len(self.workers)) if len(self.workers) > 1 else None
        self.step_times: deque[float] = deque(maxlen=256)
        self.healthy = True
        self._submitter = StepSubmitter(self.workers)
        self._in_flight: InFlightStep | None = None  # async scheduling: the step running now
        self._last_commit = 0.0
        # Runs on each step just scheduled, before the workers get it (tracing samples steps).
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None

    # ---- handshake ------------------------------------------------------------

    def _handshake(self) -> None:
        """Model info, KV spec, memory, InitializeCache on every worker, then a fresh
        scheduler (empty queues, free pool, empty prefix cache). At start and after a
        worker was lost or restarted."""
        self.model_info = self.workers[0].get_model_info()
        specs = [w.get_kv_cache_spec() for w in self.workers]
        self.kv_spec = _common_kv_spec(specs)
        self.num_blocks = self._decide_num_blocks(specs)
        for worker in self.workers:
            worker.initialize_cache(self.num_blocks)
        self.max_model_len = self._usable_model_len()
        self.scheduler = Scheduler(
            self.scheduler_config,
            num_blocks=self.num_blocks,
            block_size=self.kv_spec.block_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.model_info.eos_token_ids,
            enable_prefix_caching=self._prefix_caching(),
            pooled_prefix_hits=self.model_info.pooling_type == "LAST",
            sliding_window=self.kv_spec.sliding_window,
            rope_recompute_length=self.kv_spec.rope_recompute_length,
        )

    def _prefix_caching(self) -> bool:
        """The configured prefix caching, off where the model's keys depend on the length."""
        if self.cache_config.enable_prefix_caching and self.kv_spec.length_dependent_rope:
            log.warning("prefix caching disabled: the model's rope depends on the prompt length")
            return False
        return self.cache_config.enable_prefix_caching

    def lose_workers(self, error: str) -> list[EngineCoreOutput]:
        """A worker was lost or restarted: unhealthy until `reconnect`; every request ends
        with ERROR `error` (their blocks are freed); returns those updates."""
        self.healthy = False
        self._in_flight = None
        for worker in self.workers:
            reset = getattr(worker, "reset_stream", None)
            if reset is not None:
                reset()  # steps of the old session must not reach a new worker
        return self.scheduler.fail_all(error)

    def reconnect(self) -> None:
        """After `lose_workers`: repeat the handshake (the new KV pools are empty) and serve
        again. Raises what the handshake raises (the engine stays unhealthy then)."""
        old = self.model_info.instance_id
        self._handshake()
        log.warning(
            "reconnected to the workers (rank 0 instance %s -> %s): %d blocks",
            old or "?", self.model_info.instance_id or "?", self.num_blocks,
        )  # fmt: skip
        self.healthy = True

    def _decide_num_blocks(self, specs: list[KVCacheSpec]) -> int:
        """num_blocks_override, else the fewest blocks any worker can hold."""
        if self.cache_config.num_blocks_override:
            return self.cache_config.num_blocks_override
        num_blocks = min(
            w.determine_available_memory() // max(spec.bytes_per_block, 1)
            for w, spec in zip(self.workers, specs, strict=True)
        )
        if num_blocks < 1:
            raise ValueError("the workers have no room for a single KV block")
        log.info("KV capacity handshake: %d blocks of %d tokens", num_blocks, specs[0].block_size)
        return int(num_blocks)

    def _usable_model_len(self) -> int:
        """The model's max_model_len, capped so one request always fits in the whole pool."""
        capacity = self.num_blocks * self.kv_spec.block_size
        if capacity < self.model_info.max_model_len:
            log.warning(
                "KV pool holds %d tokens < max_model_len %d; capping max_model_len",
                capacity,
                self.model_info.max_model_len,
            )
        return min(self.model_info.max_model_len, capacity)

    # ---- requests -------------------------------------------------------------

    def validate(self, request: EngineCoreRequest) -> None:
        """Raise ValueError for a request that could never run to its first tokens."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if not all(type(t) is int for t in prompt):
            raise ValueError("prompt token ids must be integers")
        vocab = self.model_info.vocab_size
        if vocab and not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        self._check_options(request)
        self._check_runner(request)
        if request.lora_request is not None and not self.scheduler_config.lora.enable_lora:
            raise ValueError("LoRA adapters are not enabled (start with --enable-lora)")
        pooled = request.pooling_params is not None
        min_output = 0 if pooled else max(1, request.sampling_params.min_tokens)
        if len(prompt) + min_output > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + min output ({min_output}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        needed = cdiv(len(prompt) + min_output, self.kv_spec.block_size)
        if needed > self.num_blocks:
            raise ValueError(f"request needs {needed} KV blocks, the pool has {self.num_blocks}")
        if not self.scheduler_config.enable_chunked_prefill and (
            len(prompt) > self.scheduler_config.max_num_batched_tokens
        ):
            raise ValueError("prompt longer than max_num_batched_tokens with chunked prefill off")

    def _check_runner(self, request: EngineCoreRequest) -> None:
        """Embedding requests only on a pooling runner, generate requests only elsewhere."""
        pooling_runner = self.model_info.runner == "pooling"
        if request.pooling_params is not None and not pooling_runner:
            raise ValueError(
                "this model runs the generate runner; embeddings need --runner pooling"
            )
        if request.pooling_params is None and pooling_runner:
            raise ValueError(
                "this model runs the pooling runner (embeddings only); generation needs "
                "--runner generate"
            )

    def _check_options(self, request: EngineCoreRequest) -> None:
        """stop_token_ids and logit_bias keys in the vocabulary, well-formed mm_inputs,
        a finite arrival_time."""
        vocab, params = self.model_info.vocab_size, request.sampling_params
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias keys", params.logit_bias),
        ):
            if vocab and not all(0 <= t < vocab for t in ids):
                raise ValueError(f"{name} must be in [0, {vocab})")
        _check_mm_inputs(request.mm_inputs, len(request.prompt_token_ids))
        if not math.isfinite(request.arrival_time):
            raise ValueError("arrival_time must be a finite number of seconds")

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and queue a request (ValueError if it can never fit)."""
        self.validate(request)
        self.scheduler.add_request(Request.from_engine_core_request(request, self.max_model_len))

    def abort_requests(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        """Abort by id (unknown ids ignored); returns the final ABORT updates."""
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests left, or a step in flight whose output must still be collected."""
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------------

    def step(self, on_scheduled: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        """Run one engine step; returns the updates to publish.

        `on_scheduled` runs after schedule(), when the workers are busy or about to be.
        With async scheduling the step just scheduled is started on the workers and
        the outputs returned are those of the step before it (empty on the first).

        A step that raises inside a worker errors only that step's requests.
        A worker that cannot be reached fails every request, marks the engine
        unhealthy and raises WorkerLostError carrying those ERROR updates.
        """
        if self.scheduler_config.use_async_scheduling:
            return self._step_async(on_scheduled)
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(scheduler_output)
        if on_scheduled is not None:
            on_scheduled()
        return self._complete(scheduler_output, start, lambda: self._execute(scheduler_output))

    def _step_async(self, on_scheduled: Callable[[], None] | None) -> list[EngineCoreOutput]:
        """Schedule and start step n+1, then wait for step n and commit it."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(scheduler_output)
        step = None
        if has_work(scheduler_output):
            step = self._submitter.submit(scheduler_output, start)
        if on_scheduled is not None:
            on_scheduled()
        previous, self._in_flight = self._in_flight, step
        if previous is None:
            return []
        return self._complete(previous.scheduler_output, previous.start, previous.result)

    def _complete(
        self,
        scheduler_output: SchedulerOutput,
        start: float,
        wait: Callable[[], ModelRunnerOutput],
    ) -> list[EngineCoreOutput]:
        """Wait for a step's output and commit it (or fail the step)."""
        try:
            runner_output = wait()
        except WorkerUnavailableError as exc:
            log.error("worker unreachable: %s", exc)
            error = f"{WORKER_LOST}: {exc}"
            outputs = self.scheduler.fail_step(scheduler_output, error)
            outputs += self.lose_workers(error)
            raise WorkerLostError(error, outputs) from exc
        except Exception as exc:
            log.exception("step %d failed", scheduler_output.step_id)
            return self.scheduler.fail_step(scheduler_output, f"{type(exc).__name__}: {exc}")
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.perf_counter()
        seconds = now - max(start, self._last_commit)  # steps overlap when async
        self.step_times.append(seconds)
        self.scheduler.step_budget.observe(scheduler_output, seconds)
        self._last_commit = now
        return outputs

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step on every worker (concurrently when several); rank 0's output counts."""
        if self._pool is None:
            return self.workers[0].execute_model(scheduler_output)
        futures = [self._pool.submit(w.execute_model, scheduler_output) for w in self.workers]
        results = [f.result() for f in futures]
        return results[0]

    # ---- description ----------------------------------------------------------

    def server_info(self) -> ServerInfo:
        info = self.model_info
        return ServerInfo(
            model_name=info.model_name,
            max_model_len=self.max_model_len,
            vocab_size=info.vocab_size,
            block_size=self.kv_spec.block_size,
            num_blocks=self.num_blocks,
            eos_token_ids=tuple(info.eos_token_ids),
            version=VERSION,
            protocol_version=PROTOCOL_VERSION,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            enable_prefix_caching=self.cache_config.enable_prefix_caching,
            num_workers=len(self.workers),
            host_id=info.host_id,
            runner=info.runner or "generate",
        )

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.step_time_p50 = _median(self.step_times)
        stats.healthy = self.healthy
        return stats

    def shutdown(self) -> None:
        """Stop the step thread pool (the workers keep running; they are not ours to stop)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._submitter.shutdown()


MODALITIES = ("image", "audio", "video")


def _check_mm_inputs(items: Sequence[MultiModalInput], prompt_len: int) -> None:
    """Each item: a known modality, a tensor, and a non-empty placeholder span inside the
    prompt; spans ordered by offset and not overlapping."""
    end = 0
    for i, item in enumerate(items):
        where = f"mm_inputs[{i}]"
        if item.modality not in MODALITIES:
            raise ValueError(f"{where}.modality must be one of {', '.join(MODALITIES)}")
        if item.tensor is None:
            raise ValueError(f"{where} has no tensor")
        if item.length < 1 or item.offset < end or item.offset + item.length > prompt_len:
            raise ValueError(
                f"{where} spans [{item.offset}, {item.offset + item.length}): it must be "
                f"non-empty, inside the prompt ({prompt_len} tokens), after the previous item"
            )
        end = item.offset + item.length


def _median(samples: deque[float]) -> float:
    """Median of a deque another thread may append to (list() copies it atomically)."""
    values = list(samples)
    return statistics.median(values) if values else 0.0


def _common_kv_spec(specs: list[KVCacheSpec]) -> KVCacheSpec:
    """Rank 0's spec, after checking that every worker uses the same block size."""
    block_sizes = {s.block_size for s in specs}
    if len(block_sizes) != 1:
        raise ValueError(f"workers disagree on the KV block size: {sorted(block_sizes)}")
    return specs[0]
