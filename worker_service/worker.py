"""`Worker`: the in-process WorkerProtocol implementation (served over gRPC by server.py)."""

from __future__ import annotations

import logging
import os

import torch

from services.config import WorkerConfig
from services.default_model import resolve_model, served_name
from services.step_types import KVCacheSpec, ModelInfo, ModelRunnerOutput, SchedulerOutput
from services.tensor_handles import host_id
from worker_service import kv_cache
from worker_service.model_runner import ModelRunner

log = logging.getLogger(__name__)


def select_device(name: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def configure_threads(num_threads: int) -> int:
    """Set torch's intra-op threads (0 = every core this process may run on); returns the count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    count = num_threads or cores or 1
    torch.set_num_threads(count)
    return count


class Worker:
    """Loads the model at construction; then serves the WorkerProtocol calls one at a time."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = select_device(config.model.device)
        if self.device.type == "cpu":
            configure_threads(config.num_threads)
        model_dir = resolve_model(config.model.model)
        self.runner = ModelRunner(config, model_dir, self.device)
        arch = self.runner.model.config
        self.model_info = ModelInfo(
            model_name=config.model.served_model_name or served_name(config.model.model),
            max_model_len=self.runner.max_model_len,
            vocab_size=arch.vocab_size,
            eos_token_ids=arch.eos_token_ids,
            architecture=arch.architecture,
            dtype=config.model.dtype,
            device=str(self.device),
            host_id=host_id(),
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

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.spec

    def determine_available_memory(self) -> int:
        """CPU: the configured budget capped by free RAM; GPU: profiled (see ModelRunner)."""
        if self.device.type == "cuda":
            return self.runner.profile_gpu_memory(self.config.cache.gpu_memory_utilization)
        return kv_cache.cpu_kv_budget(self.config.cache.kv_cache_memory_bytes)

    def initialize_cache(self, num_blocks: int) -> int:
        allocated = self.runner.initialize_cache(num_blocks)
        log.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB",
            num_blocks,
            self.runner.block_size,
            allocated / 2**20,
        )
        return allocated

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner.num_blocks == 0 and scheduler_output.num_scheduled_tokens:
            raise RuntimeError("execute_model before initialize_cache")
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        kv_cache.release(self.runner.model)
        self.runner.num_blocks = 0
