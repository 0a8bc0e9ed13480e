"""Domain objects that cross service boundaries.

Each is declared once, in protos/: services/wire.py is generated from the messages (fields,
types, defaults and converters) and services/wire_rules.py adds the behaviour. This module
names the request-level types; services.step_types the engine-step ones. Services work with
these objects; only the gRPC edges see protobuf (services.convert).
"""

from services.wire import (
    CudaIpcLocation,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    MultiModalInput,
    PoolingParams,
    RequestTimestamps,
    SamplingParams,
    SharedMemoryLocation,
    StructuredOutputParams,
    TensorHandle,
    TokenLogprobs,
)
from services.wire_rules import MAX_LOGPROBS, MAX_N

StructuredOutputsParams = StructuredOutputParams  # vLLM's name (vllm.sampling_params)

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "CudaIpcLocation",
    "EngineCoreOutput",
    "EngineCoreRequest",
    "FinishReason",
    "LoRARequest",
    "MultiModalInput",
    "PoolingParams",
    "RequestTimestamps",
    "SamplingParams",
    "SharedMemoryLocation",
    "StructuredOutputParams",
    "StructuredOutputsParams",
    "TensorHandle",
    "TokenLogprobs",
]
