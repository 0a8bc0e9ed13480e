"""Domain objects of one engine step (scheduler <-> worker) and of the handshake.

Declared in protos/worker.proto and protos/engine.proto; generated into services/wire.py.
"""

from services.types import (
    LoRARequest,
    MultiModalInput,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)
from services.wire import (
    CachedRequestData,
    DraftTokens,
    KVCacheSpec,
    ModelInfo,
    ModelRunnerOutput,
    NewRequestData,
    PooledOutput,
    PromptLogprobs,
    SampledLogprobs,
    SchedulerOutput,
    SchedulerStats,
    ServerInfo,
    WorkerTimings,
)

__all__ = [
    "CachedRequestData",
    "DraftTokens",
    "KVCacheSpec",
    "LoRARequest",
    "ModelInfo",
    "ModelRunnerOutput",
    "MultiModalInput",
    "NewRequestData",
    "PooledOutput",
    "PoolingParams",
    "PromptLogprobs",
    "SampledLogprobs",
    "SamplingParams",
    "SchedulerOutput",
    "SchedulerStats",
    "ServerInfo",
    "TokenLogprobs",
    "WorkerTimings",
]
