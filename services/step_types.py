"""Domain objects of one engine step (scheduler <-> worker) and of the handshake.

Field names match the messages in protos/worker.proto and protos/engine.proto.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.types import (
    LoRARequest,
    MultiModalInput,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)


@dataclass(slots=True)
class NewRequestData:
    """Full data of a request the worker has not seen (or dropped at preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    resumed_from_preemption: bool = False
    pooling_params: PoolingParams | None = None  # an embedding request: pooled, not sampled
    lora_request: LoRARequest | None = None  # None: the base model


@dataclass(slots=True)
class CachedRequestData:
    """What changed for a request the worker already holds."""

    request_id: str
    new_block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


@dataclass(slots=True)
class DraftTokens:
    """Draft tokens of one request (speculative decoding)."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One engine step as decided by the scheduler."""

    step_id: int = 0
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    scheduled_spec_decode_tokens: list[DraftTokens] = field(default_factory=list)
    trace_contexts: list[str] = field(default_factory=list)  # traceparents: a sampled step


@dataclass(slots=True)
class SampledTokens:
    """Tokens sampled for one request in one step (empty inside a prefill)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of the prompt positions computed in one step."""

    request_id: str = ""
    start: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class PooledOutput:
    """The pooled vector of an embedding request whose prompt was completed this step."""

    request_id: str = ""
    data: bytes = b""  # little-endian float32


@dataclass(slots=True)
class WorkerTimings:
    """Where a worker's time went in one step, in milliseconds."""

    prepare_ms: float = 0.0
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(slots=True)
class ModelRunnerOutput:
    """The result of one step: sampled tokens aligned with req_ids."""

    step_id: int = 0
    req_ids: list[str] = field(default_factory=list)
    sampled: list[SampledTokens] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    timings: WorkerTimings = field(default_factory=WorkerTimings)
    request_errors: dict[str, str] = field(default_factory=dict)
    error: str = ""  # the whole step failed (stream form only)
    pooler_output: list[PooledOutput] = field(default_factory=list)
    draft_token_ids: list[DraftTokens] = field(default_factory=list)  # proposed for next step


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model a worker loaded."""

    model_name: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ""
    dtype: str = ""
    device: str = ""
    instance_id: str = ""  # new on every worker start
    host_id: str = ""  # host + shared-memory namespace (services.tensor_handles.host_id)
    runner: str = "generate"  # "generate" or "pooling" (embeddings)
    pooling_type: str = ""  # a pooling runner's LAST / MEAN / CLS / MAX


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Layout of one KV block on a worker."""

    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    block_size: int = 16
    bytes_per_block: int = 0
    sliding_window: int = 0  # every layer's window is at most this (0: some layer is global)
    length_dependent_rope: bool = False  # keys depend on the prompt length: no prefix caching
    rope_recompute_length: int = 0  # > 0: past this length all keys rotate anew (Phi-3)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What GetServerInfo reports."""

    model_name: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    block_size: int = 16
    num_blocks: int = 0
    eos_token_ids: tuple[int, ...] = ()
    version: str = ""
    protocol_version: str = ""
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    num_workers: int = 1
    host_id: str = ""  # rank 0 worker's host_id
    runner: str = "generate"  # "generate" or "pooling" (embeddings)


@dataclass(slots=True)
class SchedulerStats:
    """Scheduler figures at one moment; counters are totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    step_time_p50: float = 0.0
    queue_time_p50: float = 0.0
    num_finished: int = 0
    healthy: bool = True
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    iteration_tokens_bucket_counts: list[int] = field(default_factory=list)  # steps per bucket
    iteration_tokens_sum: int = 0  # tokens scheduled over all steps
