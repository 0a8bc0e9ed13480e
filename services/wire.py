"""Domain types of the wire messages and their converters.

Generated from protos/ by scripts/gen_wire_types.py (`make proto`); do not edit. Fields,
types and defaults come from the .proto files (defaults: protos/options.proto), behaviour
from services/wire_rules.py. Import the types from services.types / services.step_types and
convert with services.convert.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import Message

from services import wire_rules as rules
from services.pb import engine_pb2, tensor_pb2, worker_pb2

M = TypeVar("M", bound=Message)
T = TypeVar("T")


def _fill_each(
    messages: RepeatedCompositeFieldContainer[M], items: Iterable[T], fill: Callable[[M, T], None]
) -> None:
    add = messages.add
    for item in items:
        fill(add(), item)


class FinishReason(rules.FinishReasonRules, enum.IntEnum):
    """Why a request ended.

    tessera.v1.FinishReason in protos/engine.proto."""

    UNSPECIFIED = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


@dataclass(frozen=True, slots=True)
class StructuredOutputParams(rules.StructuredOutputParamsRules):
    """A decoding constraint: the output must match exactly one of these.

    tessera.v1.StructuredOutputParams in protos/engine.proto."""

    json: str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingParams(rules.SamplingParamsRules):
    """How to pick tokens and when to stop; the gateway expands n > 1 into n requests.

    tessera.v1.SamplingParams in protos/engine.proto."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutputParams | None = None


@dataclass(frozen=True, slots=True)
class CudaIpcLocation:
    """What torch needs to reopen a CUDA tensor exported with CUDA IPC
    (the fields of torch.multiprocessing.reductions.rebuild_cuda_tensor).

    tessera.v1.CudaIpcLocation in protos/tensor.proto."""

    device_index: int = 0
    ipc_memory_handle: bytes = b""
    storage_size_bytes: int = 0
    storage_offset_bytes: int = 0
    tensor_offset: int = 0
    stride: tuple[int, ...] = ()
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False


@dataclass(frozen=True, slots=True)
class SharedMemoryLocation:
    """A region of a POSIX shared-memory segment (/dev/shm) holding the tensor contiguously.

    tessera.v1.SharedMemoryLocation in protos/tensor.proto."""

    name: str = ""
    offset: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class TensorHandle(rules.TensorHandleRules):
    """A tensor passed by reference: the bytes stay where they are and the message
    says how to reach them (multimodal inputs, never KV tensors).

    tessera.v1.TensorHandle in protos/tensor.proto."""

    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    cuda_ipc: CudaIpcLocation | None = None
    shared_memory: SharedMemoryLocation | None = None
    inline_bytes: bytes | None = None


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One multimodal item whose processed tensor fills placeholder tokens of the prompt.

    tessera.v1.MultiModalInput in protos/engine.proto."""

    modality: str = "image"
    offset: int = 0
    length: int = 0
    content_hash: str = ""
    tensor: TensorHandle | None = None
    grid_thw: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PoolingParams(rules.PoolingParamsRules):
    """How to pool a prefill-only (embedding) request (vLLM's PoolingParams).

    tessera.v1.PoolingParams in protos/engine.proto."""

    dimensions: int | None = None
    normalize: bool | None = None


@dataclass(frozen=True, slots=True)
class LoRARequest(rules.LoRARequestRules):
    """A LoRA adapter a request runs with (vLLM's LoRARequest).

    tessera.v1.LoRARequest in protos/engine.proto."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """A tokenized request from the gateway.

    tessera.v1.EngineCoreRequest in protos/engine.proto."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str = ""
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    trace_headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class TokenLogprobs(rules.TokenLogprobsRules):
    """Log-probabilities at one position.

    tessera.v1.TokenLogprobs in protos/engine.proto."""

    token_id: int = 0
    logprob: float = 0.0
    rank: int = 0
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RequestTimestamps:
    """When a request passed each milestone (unix seconds; 0 = not yet).

    tessera.v1.RequestTimestamps in protos/engine.proto."""

    queued: float = 0.0
    scheduled: float = 0.0
    first_token: float = 0.0


@dataclass(slots=True)
class EngineCoreOutput(rules.EngineCoreOutputRules):
    """One update of one request: the tokens produced since the last update.

    tessera.v1.EngineCoreOutput in protos/engine.proto."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    timestamps: RequestTimestamps = field(default_factory=RequestTimestamps)
    error: str = ""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    pooling_output: bytes = b""


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The served model and the cache it runs with.

    tessera.v1.ServerInfo in protos/engine.proto."""

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
    host_id: str = ""
    runner: str = "generate"


@dataclass(slots=True)
class SchedulerStats:
    """Scheduler figures at one moment; counters are totals since start.

    tessera.v1.SchedulerStats in protos/engine.proto."""

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
    iteration_tokens_bucket_counts: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0


@dataclass(slots=True)
class NewRequestData:
    """Full data of a request the worker has not seen (or saw before it was preempted).

    tessera.v1.NewRequestData in protos/worker.proto."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    resumed_from_preemption: bool = False
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class CachedRequestData(rules.CachedRequestDataRules):
    """What changed for the requests the worker already holds, one column per field: entry i of
    req_ids, num_computed_tokens and num_new_blocks describe the same request (columns, not a
    message per request: a step of 256 decodes converts in a few list copies).

    tessera.v1.CachedRequestData in protos/worker.proto."""

    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class DraftTokens:
    """Draft tokens of one request (speculative decoding).

    tessera.v1.DraftTokens in protos/worker.proto."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One engine step, as decided by Scheduler.schedule().

    tessera.v1.SchedulerOutput in protos/worker.proto."""

    step_id: int = 0
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    scheduled_spec_decode_tokens: list[DraftTokens] = field(default_factory=list)
    trace_contexts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class SampledLogprobs:
    """Logprobs of the tokens one request sampled in one step.

    tessera.v1.SampledLogprobs in protos/worker.proto."""

    request_id: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of the prompt positions computed this step.

    tessera.v1.PromptLogprobs in protos/worker.proto."""

    request_id: str = ""
    start: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class WorkerTimings:
    """Where a worker's time went in one step (milliseconds).

    tessera.v1.WorkerTimings in protos/worker.proto."""

    prepare_ms: float = 0.0
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(slots=True)
class PooledOutput:
    """The pooled vector of an embedding request whose prompt was completed this step.

    tessera.v1.PooledOutput in protos/worker.proto."""

    request_id: str = ""
    data: bytes = b""


@dataclass(slots=True)
class ModelRunnerOutput(rules.ModelRunnerOutputRules):
    """The result of one step.

    tessera.v1.ModelRunnerOutput in protos/worker.proto."""

    step_id: int = 0
    req_ids: list[str] = field(default_factory=list)
    num_sampled: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[SampledLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    timings: WorkerTimings = field(default_factory=WorkerTimings)
    request_errors: dict[str, str] = field(default_factory=dict)
    error: str = ""
    pooler_output: list[PooledOutput] = field(default_factory=list)
    draft_token_ids: list[DraftTokens] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model this worker loaded.

    tessera.v1.ModelInfo in protos/worker.proto."""

    model_name: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ""
    dtype: str = ""
    device: str = ""
    instance_id: str = ""
    host_id: str = ""
    runner: str = "generate"
    pooling_type: str = ""


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Layout of one KV block on a worker.

    tessera.v1.KVCacheSpec in protos/worker.proto."""

    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    block_size: int = 16
    bytes_per_block: int = 0
    sliding_window: int = 0
    length_dependent_rope: bool = False
    rope_recompute_length: int = 0


def _fill_structured_output_params(
    msg: engine_pb2.StructuredOutputParams, obj: StructuredOutputParams
) -> None:
    if obj.json is not None:
        msg.json = obj.json
    if obj.json_object is not None:
        msg.json_object = obj.json_object
    if obj.regex is not None:
        msg.regex = obj.regex
    if obj.choice is not None:
        msg.choice.SetInParent()
        msg.choice.values.extend(obj.choice)
    if obj.grammar is not None:
        msg.grammar = obj.grammar


def _read_structured_output_params(
    msg: engine_pb2.StructuredOutputParams,
) -> StructuredOutputParams:
    return StructuredOutputParams(  # the fields in order
        msg.json if msg.HasField("json") else None,
        msg.json_object if msg.HasField("json_object") else None,
        msg.regex if msg.HasField("regex") else None,
        tuple(msg.choice.values) if msg.HasField("choice") else None,
        msg.grammar if msg.HasField("grammar") else None,
    )


def _fill_sampling_params(msg: engine_pb2.SamplingParams, obj: SamplingParams) -> None:
    msg.temperature = obj.temperature
    msg.top_p = obj.top_p
    msg.top_k = obj.top_k
    msg.min_p = obj.min_p
    if obj.seed is not None:
        msg.seed = obj.seed
    if obj.max_tokens is not None:
        msg.max_tokens = obj.max_tokens
    msg.min_tokens = obj.min_tokens
    if obj.stop_token_ids:
        msg.stop_token_ids.extend(obj.stop_token_ids)
    msg.ignore_eos = obj.ignore_eos
    msg.presence_penalty = obj.presence_penalty
    msg.frequency_penalty = obj.frequency_penalty
    msg.repetition_penalty = obj.repetition_penalty
    if obj.logit_bias:
        msg.logit_bias.update(obj.logit_bias)
    if obj.logprobs is not None:
        msg.logprobs = obj.logprobs
    if obj.prompt_logprobs is not None:
        msg.prompt_logprobs = obj.prompt_logprobs
    if obj.structured_output is not None:
        msg.structured_output.SetInParent()
        _fill_structured_output_params(msg.structured_output, obj.structured_output)


def _read_sampling_params(msg: engine_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(  # the fields in order
        msg.temperature if msg.HasField("temperature") else 1.0,
        msg.top_p if msg.HasField("top_p") else 1.0,
        msg.top_k,
        msg.min_p,
        msg.seed if msg.HasField("seed") else None,
        msg.max_tokens if msg.HasField("max_tokens") else None,
        msg.min_tokens,
        tuple(msg.stop_token_ids),
        msg.ignore_eos,
        msg.presence_penalty,
        msg.frequency_penalty,
        msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        dict(msg.logit_bias),
        msg.logprobs if msg.HasField("logprobs") else None,
        msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        _read_structured_output_params(msg.structured_output)
        if msg.HasField("structured_output")
        else None,
    )


def _fill_cuda_ipc_location(msg: tensor_pb2.CudaIpcLocation, obj: CudaIpcLocation) -> None:
    msg.device_index = obj.device_index
    msg.ipc_memory_handle = obj.ipc_memory_handle
    msg.storage_size_bytes = obj.storage_size_bytes
    msg.storage_offset_bytes = obj.storage_offset_bytes
    msg.tensor_offset = obj.tensor_offset
    if obj.stride:
        msg.stride.extend(obj.stride)
    msg.ref_counter_handle = obj.ref_counter_handle
    msg.ref_counter_offset = obj.ref_counter_offset
    msg.event_handle = obj.event_handle
    msg.event_sync_required = obj.event_sync_required


def _read_cuda_ipc_location(msg: tensor_pb2.CudaIpcLocation) -> CudaIpcLocation:
    return CudaIpcLocation(  # the fields in order
        msg.device_index,
        msg.ipc_memory_handle,
        msg.storage_size_bytes,
        msg.storage_offset_bytes,
        msg.tensor_offset,
        tuple(msg.stride),
        msg.ref_counter_handle,
        msg.ref_counter_offset,
        msg.event_handle,
        msg.event_sync_required,
    )


def _fill_shared_memory_location(
    msg: tensor_pb2.SharedMemoryLocation, obj: SharedMemoryLocation
) -> None:
    msg.name = obj.name
    msg.offset = obj.offset
    msg.nbytes = obj.nbytes


def _read_shared_memory_location(msg: tensor_pb2.SharedMemoryLocation) -> SharedMemoryLocation:
    return SharedMemoryLocation(  # the fields in order
        msg.name,
        msg.offset,
        msg.nbytes,
    )


def _fill_tensor_handle(msg: tensor_pb2.TensorHandle, obj: TensorHandle) -> None:
    msg.dtype = obj.dtype
    if obj.shape:
        msg.shape.extend(obj.shape)
    if obj.cuda_ipc is not None:
        msg.cuda_ipc.SetInParent()
        _fill_cuda_ipc_location(msg.cuda_ipc, obj.cuda_ipc)
    if obj.shared_memory is not None:
        msg.shared_memory.SetInParent()
        _fill_shared_memory_location(msg.shared_memory, obj.shared_memory)
    if obj.inline_bytes is not None:
        msg.inline_bytes = obj.inline_bytes


def _read_tensor_handle(msg: tensor_pb2.TensorHandle) -> TensorHandle:
    return TensorHandle(  # the fields in order
        msg.dtype if msg.HasField("dtype") else "float32",
        tuple(msg.shape),
        _read_cuda_ipc_location(msg.cuda_ipc) if msg.HasField("cuda_ipc") else None,
        _read_shared_memory_location(msg.shared_memory) if msg.HasField("shared_memory") else None,
        msg.inline_bytes if msg.HasField("inline_bytes") else None,
    )


def _fill_multi_modal_input(msg: engine_pb2.MultiModalInput, obj: MultiModalInput) -> None:
    msg.modality = obj.modality
    msg.offset = obj.offset
    msg.length = obj.length
    msg.content_hash = obj.content_hash
    if obj.tensor is not None:
        msg.tensor.SetInParent()
        _fill_tensor_handle(msg.tensor, obj.tensor)
    if obj.grid_thw:
        msg.grid_thw.extend(obj.grid_thw)


def _read_multi_modal_input(msg: engine_pb2.MultiModalInput) -> MultiModalInput:
    return MultiModalInput(  # the fields in order
        msg.modality if msg.HasField("modality") else "image",
        msg.offset,
        msg.length,
        msg.content_hash,
        _read_tensor_handle(msg.tensor) if msg.HasField("tensor") else None,
        msg.grid_thw[:],
    )


def _fill_pooling_params(msg: engine_pb2.PoolingParams, obj: PoolingParams) -> None:
    if obj.dimensions is not None:
        msg.dimensions = obj.dimensions
    if obj.normalize is not None:
        msg.normalize = obj.normalize


def _read_pooling_params(msg: engine_pb2.PoolingParams) -> PoolingParams:
    return PoolingParams(  # the fields in order
        msg.dimensions if msg.HasField("dimensions") else None,
        msg.normalize if msg.HasField("normalize") else None,
    )


def _fill_lora_request(msg: engine_pb2.LoRARequest, obj: LoRARequest) -> None:
    msg.lora_name = obj.lora_name
    msg.lora_int_id = obj.lora_int_id
    msg.lora_path = obj.lora_path


def _read_lora_request(msg: engine_pb2.LoRARequest) -> LoRARequest:
    return LoRARequest(  # the fields in order
        msg.lora_name,
        msg.lora_int_id,
        msg.lora_path,
    )


def _fill_engine_core_request(msg: engine_pb2.EngineCoreRequest, obj: EngineCoreRequest) -> None:
    msg.request_id = obj.request_id
    if obj.prompt_token_ids:
        msg.prompt_token_ids.extend(obj.prompt_token_ids)
    _fill_sampling_params(msg.sampling_params, obj.sampling_params)
    msg.arrival_time = obj.arrival_time
    msg.priority = obj.priority
    msg.cache_salt = obj.cache_salt
    if obj.mm_inputs:
        _fill_each(msg.mm_inputs, obj.mm_inputs, _fill_multi_modal_input)
    if obj.pooling_params is not None:
        msg.pooling_params.SetInParent()
        _fill_pooling_params(msg.pooling_params, obj.pooling_params)
    if obj.lora_request is not None:
        msg.lora_request.SetInParent()
        _fill_lora_request(msg.lora_request, obj.lora_request)
    if obj.trace_headers:
        msg.trace_headers.update(obj.trace_headers)


def _read_engine_core_request(msg: engine_pb2.EngineCoreRequest) -> EngineCoreRequest:
    return EngineCoreRequest(  # the fields in order
        msg.request_id,
        msg.prompt_token_ids[:],
        _read_sampling_params(msg.sampling_params),
        msg.arrival_time,
        msg.priority,
        msg.cache_salt,
        list(map(_read_multi_modal_input, msg.mm_inputs)) if msg.mm_inputs else [],
        _read_pooling_params(msg.pooling_params) if msg.HasField("pooling_params") else None,
        _read_lora_request(msg.lora_request) if msg.HasField("lora_request") else None,
        dict(msg.trace_headers),
    )


def _fill_token_logprobs(msg: engine_pb2.TokenLogprobs, obj: TokenLogprobs) -> None:
    msg.token_id = obj.token_id
    msg.logprob = obj.logprob
    msg.rank = obj.rank
    if obj.top_token_ids:
        msg.top_token_ids.extend(obj.top_token_ids)
    if obj.top_logprobs:
        msg.top_logprobs.extend(obj.top_logprobs)


def _read_token_logprobs(msg: engine_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(  # the fields in order
        msg.token_id,
        msg.logprob,
        msg.rank,
        msg.top_token_ids[:],
        msg.top_logprobs[:],
    )


def _fill_request_timestamps(msg: engine_pb2.RequestTimestamps, obj: RequestTimestamps) -> None:
    msg.queued = obj.queued
    msg.scheduled = obj.scheduled
    msg.first_token = obj.first_token


def _read_request_timestamps(msg: engine_pb2.RequestTimestamps) -> RequestTimestamps:
    return RequestTimestamps(  # the fields in order
        msg.queued,
        msg.scheduled,
        msg.first_token,
    )


def _fill_engine_core_output(msg: engine_pb2.EngineCoreOutput, obj: EngineCoreOutput) -> None:
    msg.request_id = obj.request_id
    if obj.new_token_ids:
        msg.new_token_ids.extend(obj.new_token_ids)
    if obj.new_logprobs:
        _fill_each(msg.new_logprobs, obj.new_logprobs, _fill_token_logprobs)
    msg.finish_reason = engine_pb2.FinishReason.ValueType(obj.finish_reason)
    if obj.stop_reason is not None:
        msg.stop_reason = obj.stop_reason
    msg.num_cached_tokens = obj.num_cached_tokens
    _fill_request_timestamps(msg.timestamps, obj.timestamps)
    msg.error = obj.error
    if obj.prompt_logprobs:
        _fill_each(msg.prompt_logprobs, obj.prompt_logprobs, _fill_token_logprobs)
    msg.pooling_output = obj.pooling_output


def _read_engine_core_output(msg: engine_pb2.EngineCoreOutput) -> EngineCoreOutput:
    return EngineCoreOutput(  # the fields in order
        msg.request_id,
        msg.new_token_ids[:],
        list(map(_read_token_logprobs, msg.new_logprobs)) if msg.new_logprobs else [],
        FinishReason(msg.finish_reason),
        msg.stop_reason if msg.HasField("stop_reason") else None,
        msg.num_cached_tokens,
        _read_request_timestamps(msg.timestamps),
        msg.error,
        list(map(_read_token_logprobs, msg.prompt_logprobs)) if msg.prompt_logprobs else [],
        msg.pooling_output,
    )


def _fill_server_info(msg: engine_pb2.ServerInfo, obj: ServerInfo) -> None:
    msg.model_name = obj.model_name
    msg.max_model_len = obj.max_model_len
    msg.vocab_size = obj.vocab_size
    msg.block_size = obj.block_size
    msg.num_blocks = obj.num_blocks
    if obj.eos_token_ids:
        msg.eos_token_ids.extend(obj.eos_token_ids)
    msg.version = obj.version
    msg.protocol_version = obj.protocol_version
    msg.max_num_seqs = obj.max_num_seqs
    msg.max_num_batched_tokens = obj.max_num_batched_tokens
    msg.enable_prefix_caching = obj.enable_prefix_caching
    msg.num_workers = obj.num_workers
    msg.host_id = obj.host_id
    msg.runner = obj.runner


def _read_server_info(msg: engine_pb2.ServerInfo) -> ServerInfo:
    return ServerInfo(  # the fields in order
        msg.model_name,
        msg.max_model_len,
        msg.vocab_size,
        msg.block_size if msg.HasField("block_size") else 16,
        msg.num_blocks,
        tuple(msg.eos_token_ids),
        msg.version,
        msg.protocol_version,
        msg.max_num_seqs,
        msg.max_num_batched_tokens,
        msg.enable_prefix_caching if msg.HasField("enable_prefix_caching") else True,
        msg.num_workers if msg.HasField("num_workers") else 1,
        msg.host_id,
        msg.runner if msg.HasField("runner") else "generate",
    )


def _fill_scheduler_stats(msg: engine_pb2.SchedulerStats, obj: SchedulerStats) -> None:
    msg.num_running = obj.num_running
    msg.num_waiting = obj.num_waiting
    msg.num_blocks_total = obj.num_blocks_total
    msg.num_blocks_used = obj.num_blocks_used
    msg.kv_cache_usage = obj.kv_cache_usage
    msg.prefix_cache_queries = obj.prefix_cache_queries
    msg.prefix_cache_hits = obj.prefix_cache_hits
    msg.num_preemptions = obj.num_preemptions
    msg.num_steps = obj.num_steps
    msg.step_time_p50 = obj.step_time_p50
    msg.queue_time_p50 = obj.queue_time_p50
    msg.num_finished = obj.num_finished
    msg.healthy = obj.healthy
    msg.spec_decode_num_drafts = obj.spec_decode_num_drafts
    msg.spec_decode_num_draft_tokens = obj.spec_decode_num_draft_tokens
    msg.spec_decode_num_accepted_tokens = obj.spec_decode_num_accepted_tokens
    if obj.iteration_tokens_bucket_counts:
        msg.iteration_tokens_bucket_counts.extend(obj.iteration_tokens_bucket_counts)
    msg.iteration_tokens_sum = obj.iteration_tokens_sum


def _read_scheduler_stats(msg: engine_pb2.SchedulerStats) -> SchedulerStats:
    return SchedulerStats(  # the fields in order
        msg.num_running,
        msg.num_waiting,
        msg.num_blocks_total,
        msg.num_blocks_used,
        msg.kv_cache_usage,
        msg.prefix_cache_queries,
        msg.prefix_cache_hits,
        msg.num_preemptions,
        msg.num_steps,
        msg.step_time_p50,
        msg.queue_time_p50,
        msg.num_finished,
        msg.healthy if msg.HasField("healthy") else True,
        msg.spec_decode_num_drafts,
        msg.spec_decode_num_draft_tokens,
        msg.spec_decode_num_accepted_tokens,
        msg.iteration_tokens_bucket_counts[:],
        msg.iteration_tokens_sum,
    )


def _fill_new_request_data(msg: worker_pb2.NewRequestData, obj: NewRequestData) -> None:
    msg.request_id = obj.request_id
    if obj.prompt_token_ids:
        msg.prompt_token_ids.extend(obj.prompt_token_ids)
    if obj.output_token_ids:
        msg.output_token_ids.extend(obj.output_token_ids)
    _fill_sampling_params(msg.sampling_params, obj.sampling_params)
    if obj.block_ids:
        msg.block_ids.extend(obj.block_ids)
    msg.num_computed_tokens = obj.num_computed_tokens
    if obj.mm_inputs:
        _fill_each(msg.mm_inputs, obj.mm_inputs, _fill_multi_modal_input)
    msg.resumed_from_preemption = obj.resumed_from_preemption
    if obj.pooling_params is not None:
        msg.pooling_params.SetInParent()
        _fill_pooling_params(msg.pooling_params, obj.pooling_params)
    if obj.lora_request is not None:
        msg.lora_request.SetInParent()
        _fill_lora_request(msg.lora_request, obj.lora_request)


def _read_new_request_data(msg: worker_pb2.NewRequestData) -> NewRequestData:
    return NewRequestData(  # the fields in order
        msg.request_id,
        msg.prompt_token_ids[:],
        msg.output_token_ids[:],
        _read_sampling_params(msg.sampling_params),
        msg.block_ids[:],
        msg.num_computed_tokens,
        list(map(_read_multi_modal_input, msg.mm_inputs)) if msg.mm_inputs else [],
        msg.resumed_from_preemption,
        _read_pooling_params(msg.pooling_params) if msg.HasField("pooling_params") else None,
        _read_lora_request(msg.lora_request) if msg.HasField("lora_request") else None,
    )


def _fill_cached_request_data(msg: worker_pb2.CachedRequestData, obj: CachedRequestData) -> None:
    if obj.req_ids:
        msg.req_ids.extend(obj.req_ids)
    if obj.num_computed_tokens:
        msg.num_computed_tokens.extend(obj.num_computed_tokens)
    if obj.num_new_blocks:
        msg.num_new_blocks.extend(obj.num_new_blocks)
    if obj.new_block_ids:
        msg.new_block_ids.extend(obj.new_block_ids)


def _read_cached_request_data(msg: worker_pb2.CachedRequestData) -> CachedRequestData:
    return CachedRequestData(  # the fields in order
        msg.req_ids[:],
        msg.num_computed_tokens[:],
        msg.num_new_blocks[:],
        msg.new_block_ids[:],
    )


def _fill_draft_tokens(msg: worker_pb2.DraftTokens, obj: DraftTokens) -> None:
    msg.request_id = obj.request_id
    if obj.token_ids:
        msg.token_ids.extend(obj.token_ids)


def _read_draft_tokens(msg: worker_pb2.DraftTokens) -> DraftTokens:
    return DraftTokens(  # the fields in order
        msg.request_id,
        msg.token_ids[:],
    )


def _fill_scheduler_output(msg: worker_pb2.SchedulerOutput, obj: SchedulerOutput) -> None:
    msg.step_id = obj.step_id
    if obj.scheduled_new_reqs:
        _fill_each(msg.scheduled_new_reqs, obj.scheduled_new_reqs, _fill_new_request_data)
    _fill_cached_request_data(msg.scheduled_cached_reqs, obj.scheduled_cached_reqs)
    if obj.num_scheduled_tokens:
        msg.num_scheduled_tokens.update(obj.num_scheduled_tokens)
    msg.total_num_scheduled_tokens = obj.total_num_scheduled_tokens
    if obj.finished_req_ids:
        msg.finished_req_ids.extend(obj.finished_req_ids)
    if obj.preempted_req_ids:
        msg.preempted_req_ids.extend(obj.preempted_req_ids)
    if obj.scheduled_spec_decode_tokens:
        _fill_each(
            msg.scheduled_spec_decode_tokens, obj.scheduled_spec_decode_tokens, _fill_draft_tokens
        )
    if obj.trace_contexts:
        msg.trace_contexts.extend(obj.trace_contexts)


def _read_scheduler_output(msg: worker_pb2.SchedulerOutput) -> SchedulerOutput:
    return SchedulerOutput(  # the fields in order
        msg.step_id,
        list(map(_read_new_request_data, msg.scheduled_new_reqs)) if msg.scheduled_new_reqs else [],
        _read_cached_request_data(msg.scheduled_cached_reqs),
        dict(msg.num_scheduled_tokens),
        msg.total_num_scheduled_tokens,
        msg.finished_req_ids[:],
        msg.preempted_req_ids[:],
        list(map(_read_draft_tokens, msg.scheduled_spec_decode_tokens))
        if msg.scheduled_spec_decode_tokens
        else [],
        msg.trace_contexts[:],
    )


def _fill_sampled_logprobs(msg: worker_pb2.SampledLogprobs, obj: SampledLogprobs) -> None:
    msg.request_id = obj.request_id
    if obj.logprobs:
        _fill_each(msg.logprobs, obj.logprobs, _fill_token_logprobs)


def _read_sampled_logprobs(msg: worker_pb2.SampledLogprobs) -> SampledLogprobs:
    return SampledLogprobs(  # the fields in order
        msg.request_id,
        list(map(_read_token_logprobs, msg.logprobs)) if msg.logprobs else [],
    )


def _fill_prompt_logprobs(msg: worker_pb2.PromptLogprobs, obj: PromptLogprobs) -> None:
    msg.request_id = obj.request_id
    msg.start = obj.start
    if obj.logprobs:
        _fill_each(msg.logprobs, obj.logprobs, _fill_token_logprobs)


def _read_prompt_logprobs(msg: worker_pb2.PromptLogprobs) -> PromptLogprobs:
    return PromptLogprobs(  # the fields in order
        msg.request_id,
        msg.start,
        list(map(_read_token_logprobs, msg.logprobs)) if msg.logprobs else [],
    )


def _fill_worker_timings(msg: worker_pb2.WorkerTimings, obj: WorkerTimings) -> None:
    msg.prepare_ms = obj.prepare_ms
    msg.forward_ms = obj.forward_ms
    msg.sample_ms = obj.sample_ms
    msg.total_ms = obj.total_ms


def _read_worker_timings(msg: worker_pb2.WorkerTimings) -> WorkerTimings:
    return WorkerTimings(  # the fields in order
        msg.prepare_ms,
        msg.forward_ms,
        msg.sample_ms,
        msg.total_ms,
    )


def _fill_pooled_output(msg: worker_pb2.PooledOutput, obj: PooledOutput) -> None:
    msg.request_id = obj.request_id
    msg.data = obj.data


def _read_pooled_output(msg: worker_pb2.PooledOutput) -> PooledOutput:
    return PooledOutput(  # the fields in order
        msg.request_id,
        msg.data,
    )


def _fill_model_runner_output(msg: worker_pb2.ModelRunnerOutput, obj: ModelRunnerOutput) -> None:
    msg.step_id = obj.step_id
    if obj.req_ids:
        msg.req_ids.extend(obj.req_ids)
    if obj.num_sampled:
        msg.num_sampled.extend(obj.num_sampled)
    if obj.sampled_token_ids:
        msg.sampled_token_ids.extend(obj.sampled_token_ids)
    if obj.sampled_logprobs:
        _fill_each(msg.sampled_logprobs, obj.sampled_logprobs, _fill_sampled_logprobs)
    if obj.prompt_logprobs:
        _fill_each(msg.prompt_logprobs, obj.prompt_logprobs, _fill_prompt_logprobs)
    _fill_worker_timings(msg.timings, obj.timings)
    if obj.request_errors:
        msg.request_errors.update(obj.request_errors)
    msg.error = obj.error
    if obj.pooler_output:
        _fill_each(msg.pooler_output, obj.pooler_output, _fill_pooled_output)
    if obj.draft_token_ids:
        _fill_each(msg.draft_token_ids, obj.draft_token_ids, _fill_draft_tokens)


def _read_model_runner_output(msg: worker_pb2.ModelRunnerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(  # the fields in order
        msg.step_id,
        msg.req_ids[:],
        msg.num_sampled[:],
        msg.sampled_token_ids[:],
        list(map(_read_sampled_logprobs, msg.sampled_logprobs)) if msg.sampled_logprobs else [],
        list(map(_read_prompt_logprobs, msg.prompt_logprobs)) if msg.prompt_logprobs else [],
        _read_worker_timings(msg.timings),
        dict(msg.request_errors),
        msg.error,
        list(map(_read_pooled_output, msg.pooler_output)) if msg.pooler_output else [],
        list(map(_read_draft_tokens, msg.draft_token_ids)) if msg.draft_token_ids else [],
    )


def _fill_model_info(msg: worker_pb2.ModelInfo, obj: ModelInfo) -> None:
    msg.model_name = obj.model_name
    msg.max_model_len = obj.max_model_len
    msg.vocab_size = obj.vocab_size
    if obj.eos_token_ids:
        msg.eos_token_ids.extend(obj.eos_token_ids)
    msg.architecture = obj.architecture
    msg.dtype = obj.dtype
    msg.device = obj.device
    msg.instance_id = obj.instance_id
    msg.host_id = obj.host_id
    msg.runner = obj.runner
    msg.pooling_type = obj.pooling_type


def _read_model_info(msg: worker_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(  # the fields in order
        msg.model_name,
        msg.max_model_len,
        msg.vocab_size,
        tuple(msg.eos_token_ids),
        msg.architecture,
        msg.dtype,
        msg.device,
        msg.instance_id,
        msg.host_id,
        msg.runner if msg.HasField("runner") else "generate",
        msg.pooling_type,
    )


def _fill_kv_cache_spec(msg: worker_pb2.KVCacheSpec, obj: KVCacheSpec) -> None:
    msg.num_layers = obj.num_layers
    msg.num_kv_heads = obj.num_kv_heads
    msg.head_dim = obj.head_dim
    msg.dtype = obj.dtype
    msg.block_size = obj.block_size
    msg.bytes_per_block = obj.bytes_per_block
    msg.sliding_window = obj.sliding_window
    msg.length_dependent_rope = obj.length_dependent_rope
    msg.rope_recompute_length = obj.rope_recompute_length


def _read_kv_cache_spec(msg: worker_pb2.KVCacheSpec) -> KVCacheSpec:
    return KVCacheSpec(  # the fields in order
        msg.num_layers,
        msg.num_kv_heads,
        msg.head_dim,
        msg.dtype,
        msg.block_size if msg.HasField("block_size") else 16,
        msg.bytes_per_block,
        msg.sliding_window,
        msg.length_dependent_rope,
        msg.rope_recompute_length,
    )


# Each type's message and converters, for services.convert.
MESSAGES: dict[type, type[Message]] = {
    StructuredOutputParams: engine_pb2.StructuredOutputParams,
    SamplingParams: engine_pb2.SamplingParams,
    CudaIpcLocation: tensor_pb2.CudaIpcLocation,
    SharedMemoryLocation: tensor_pb2.SharedMemoryLocation,
    TensorHandle: tensor_pb2.TensorHandle,
    MultiModalInput: engine_pb2.MultiModalInput,
    PoolingParams: engine_pb2.PoolingParams,
    LoRARequest: engine_pb2.LoRARequest,
    EngineCoreRequest: engine_pb2.EngineCoreRequest,
    TokenLogprobs: engine_pb2.TokenLogprobs,
    RequestTimestamps: engine_pb2.RequestTimestamps,
    EngineCoreOutput: engine_pb2.EngineCoreOutput,
    ServerInfo: engine_pb2.ServerInfo,
    SchedulerStats: engine_pb2.SchedulerStats,
    NewRequestData: worker_pb2.NewRequestData,
    CachedRequestData: worker_pb2.CachedRequestData,
    DraftTokens: worker_pb2.DraftTokens,
    SchedulerOutput: worker_pb2.SchedulerOutput,
    SampledLogprobs: worker_pb2.SampledLogprobs,
    PromptLogprobs: worker_pb2.PromptLogprobs,
    WorkerTimings: worker_pb2.WorkerTimings,
    PooledOutput: worker_pb2.PooledOutput,
    ModelRunnerOutput: worker_pb2.ModelRunnerOutput,
    ModelInfo: worker_pb2.ModelInfo,
    KVCacheSpec: worker_pb2.KVCacheSpec,
}
FILL: dict[type, Callable[[Any, Any], None]] = {
    StructuredOutputParams: _fill_structured_output_params,
    SamplingParams: _fill_sampling_params,
    CudaIpcLocation: _fill_cuda_ipc_location,
    SharedMemoryLocation: _fill_shared_memory_location,
    TensorHandle: _fill_tensor_handle,
    MultiModalInput: _fill_multi_modal_input,
    PoolingParams: _fill_pooling_params,
    LoRARequest: _fill_lora_request,
    EngineCoreRequest: _fill_engine_core_request,
    TokenLogprobs: _fill_token_logprobs,
    RequestTimestamps: _fill_request_timestamps,
    EngineCoreOutput: _fill_engine_core_output,
    ServerInfo: _fill_server_info,
    SchedulerStats: _fill_scheduler_stats,
    NewRequestData: _fill_new_request_data,
    CachedRequestData: _fill_cached_request_data,
    DraftTokens: _fill_draft_tokens,
    SchedulerOutput: _fill_scheduler_output,
    SampledLogprobs: _fill_sampled_logprobs,
    PromptLogprobs: _fill_prompt_logprobs,
    WorkerTimings: _fill_worker_timings,
    PooledOutput: _fill_pooled_output,
    ModelRunnerOutput: _fill_model_runner_output,
    ModelInfo: _fill_model_info,
    KVCacheSpec: _fill_kv_cache_spec,
}
READ: dict[type, Callable[[Any], Any]] = {
    StructuredOutputParams: _read_structured_output_params,
    SamplingParams: _read_sampling_params,
    CudaIpcLocation: _read_cuda_ipc_location,
    SharedMemoryLocation: _read_shared_memory_location,
    TensorHandle: _read_tensor_handle,
    MultiModalInput: _read_multi_modal_input,
    PoolingParams: _read_pooling_params,
    LoRARequest: _read_lora_request,
    EngineCoreRequest: _read_engine_core_request,
    TokenLogprobs: _read_token_logprobs,
    RequestTimestamps: _read_request_timestamps,
    EngineCoreOutput: _read_engine_core_output,
    ServerInfo: _read_server_info,
    SchedulerStats: _read_scheduler_stats,
    NewRequestData: _read_new_request_data,
    CachedRequestData: _read_cached_request_data,
    DraftTokens: _read_draft_tokens,
    SchedulerOutput: _read_scheduler_output,
    SampledLogprobs: _read_sampled_logprobs,
    PromptLogprobs: _read_prompt_logprobs,
    WorkerTimings: _read_worker_timings,
    PooledOutput: _read_pooled_output,
    ModelRunnerOutput: _read_model_runner_output,
    ModelInfo: _read_model_info,
    KVCacheSpec: _read_kv_cache_spec,
}
