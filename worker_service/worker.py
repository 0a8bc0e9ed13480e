"""`Worker`: the in-process WorkerProtocol implementation (served over gRPC by server.py)."""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import Future

import torch

from services.config import WorkerConfig
from services.default_model import resolve_model, served_name, weights_source
from services.step_types import KVCacheSpec, ModelInfo, ModelRunnerOutput, SchedulerOutput
from services.tensor_handles import host_id
from worker_service import kv_cache
from worker_service.model_runner import ModelRunner
from worker_service.model_thread import model_thread, on_model_thread
from worker_service.parallel import TPGroup, start_group

log = logging.getLogger(__name__)


def select_device(name: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def configure_threads(num_threads: int, ranks_per_host: int = 1) -> int:
    """Set torch's intra-op threads (0 = this process's share of the cores it may run on, when
    `ranks_per_host` tensor-parallel ranks share them); returns the count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    count = num_threads or max(1, (cores or 1) // ranks_per_host)
    torch.set_num_threads(count)
    return count


class Worker:
    """Loads the model at construction; then serves the WorkerProtocol calls one at a time,
    each on the process's model thread (model_thread: why).

    With tensor parallelism this is every rank's worker: rank 0 (built without `tp`) starts
    the group and sends each call to the other ranks (worker_service.parallel)."""

    def __init__(self, config: WorkerConfig, tp: TPGroup | None = None) -> None:
        self.thread = model_thread()  # loads, allocates and executes: one OpenMP team
        self.thread.call(self._load, config, tp)

    def _load(self, config: WorkerConfig, tp: TPGroup | None) -> None:
        self.config = config
        self.device = select_device(config.model.device)
        self.tp = tp if tp is not None else start_group(config, self.device)
        self.device = self.tp.local_device(self.device)
        if self.device.type == "cpu":
            configure_threads(
                config.num_threads, self.tp.size if config.parallel.spawn_ranks else 1
            )
        source = weights_source(config.model.model, config.model.quantization)
        model_dir = resolve_model(source, config.model.hub)
        self.runner = ModelRunner(config, model_dir, self.device, self.tp)
        arch = self.runner.model.config
        self.model_info = ModelInfo(
            model_name=config.model.served_model_name or served_name(config.model.model),
            max_model_len=self.runner.max_model_len,
            vocab_size=arch.vocab_size,
            eos_token_ids=arch.eos_token_ids,
            architecture=arch.architecture,
            dtype=config.model.dtype,
            device=str(self.device),
            instance_id=uuid.uuid4().hex,  # new on every start: the scheduler spots a restart
            host_id=host_id(),
            runner=config.model.runner,
            pooling_type=pooler.pooling_type if (pooler := self.runner.pooler.config) else "",
        )
        log.info(
            "loaded %s (%s, %s) on %s, attention backend %s",
            model_dir,
            arch.architecture,
            config.model.dtype,
            self.device,
            self.runner.backend.name,
        )

    def get_model_info(self) -> ModelInfo:
        return self.model_info

    @on_model_thread
    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.kv_spec

    @on_model_thread
    def determine_available_memory(self) -> int:
        """CPU: the configured budget capped by free RAM; GPU: profiled (see ModelRunner).
        A handshake is starting, so a pool an earlier scheduler had is released first (it
        would count as used memory). Tensor parallel: each rank's own budget; what this returns
        makes the scheduler pick the fewest blocks any rank can hold (ranks' blocks differ in
        size: their KV heads)."""
        self._release_pool()
        self.tp.command("memory")
        if self.device.type == "cuda":
            available = self.runner.profile_gpu_memory(self.config.cache.gpu_memory_utilization)
        else:
            available = kv_cache.cpu_kv_budget(self.config.cache.kv_cache_memory_bytes)
        if self.tp.size == 1:
            return available
        block = self.runner.kv_spec.bytes_per_block
        return self.tp.min_over_ranks(available // block) * block

    @on_model_thread
    def initialize_cache(self, num_blocks: int) -> int:
        """Allocate the KV pool; a (re)connecting scheduler starts a fresh session, so the
        requests an earlier scheduler left in the batch are dropped."""
        for request_id in list(self.runner.input_batch.requests):
            self.runner.input_batch.remove(request_id)
        self._release_pool()  # never two pools at once
        self.tp.command("cache", num_blocks)
        allocated = self.runner.initialize_cache(num_blocks)
        log.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB",
            num_blocks,
            self.runner.block_size,
            allocated / 2**20,
        )
        return allocated

    def _release_pool(self) -> None:
        if self.runner.num_blocks:
            self.runner.release_cache()

    @on_model_thread
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner.num_blocks == 0 and scheduler_output.num_scheduled_tokens:
            raise RuntimeError("execute_model before initialize_cache")
        return self.runner.execute_model(scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """execute_model started on the model thread (scheduler_service.pipeline's steps)."""
        return self.thread.submit(self.execute_model, scheduler_output)

    @on_model_thread
    def shutdown(self) -> None:
        self.runner.release_cache()
        self.tp.stop()
