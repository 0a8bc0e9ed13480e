"""Domain objects that cross service boundaries.

Each dataclass mirrors one protobuf message in protos/ field for field (same
names), so `services.convert` can translate both ways generically. Services
work with these objects; only the gRPC edges see protobuf.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top logprobs per token the engine computes at most
MAX_N = 64  # choices per request the gateway accepts at most (--max-n may lower it)


class FinishReason(enum.IntEnum):
    """Why a request ended (values match tessera.v1.FinishReason)."""

    UNSPECIFIED = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4

    @property
    def openai_name(self) -> str | None:
        """The OpenAI `finish_reason` string; None while running."""
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}.get(int(self))


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """One decoding constraint (vLLM's StructuredOutputsParams); exactly one field is set."""

    json: str | None = None  # a JSON schema, serialized as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches this regular expression
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF in the backend's dialect (Lark or GBNF, see llguidance)

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):  # accept a list, keep the object hashable
            object.__setattr__(self, "choice", tuple(self.choice))
        values = (self.json, self.json_object or None, self.regex, self.choice, self.grammar)
        if sum(v is not None for v in values) != 1:
            raise ValueError(
                "structured_output needs exactly one of json, json_object, regex, choice, grammar"
            )


StructuredOutputsParams = StructuredOutputParams  # vLLM's name (vllm.sampling_params)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM semantics)."""

    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0  # nucleus mass; 1 is off
    top_k: int = 0  # 0 or -1 is off
    min_p: float = 0.0  # relative probability floor; 0 is off
    seed: int | None = None  # per-request generator seed
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop ids are masked until this many tokens exist
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top-k logprobs per sampled token; 0: only the sampled one
    prompt_logprobs: int | None = None  # same, per prompt token
    structured_output: StructuredOutputParams | None = None  # a decoding constraint

    def __post_init__(self) -> None:
        _check(self.temperature >= 0 and math.isfinite(self.temperature), "temperature", ">= 0")
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        _check(self.top_k >= -1, "top_k", "-1, 0 (off) or a positive integer")
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1")
        _check(self.min_tokens >= 0, "min_tokens", ">= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"<= max_tokens ({self.max_tokens})",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2 <= getattr(self, name) <= 2, name, "in [-2, 2]")
        _check(0 < self.repetition_penalty <= 100, "repetition_penalty", "in (0, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"in [0, {MAX_LOGPROBS}]")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative ids")
        _check(all(t >= 0 for t in self.logit_bias), "logit_bias", "keyed by token ids >= 0")
        _check(
            all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias", "in [-100, 100]"
        )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How to pool an embedding request (vLLM's PoolingParams for the embed task)."""

    dimensions: int | None = None  # Matryoshka truncation (models that allow it); None: all
    normalize: bool | None = None  # L2-normalize; None: the model's default

    def __post_init__(self) -> None:
        _check(self.dimensions is None or self.dimensions >= 1, "dimensions", ">= 1")


def _check(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}")


@dataclass(frozen=True, slots=True)
class CudaIpcLocation:
    """What torch needs to reopen a CUDA tensor in another process."""

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
    """A contiguous region of a POSIX shared-memory segment."""

    name: str = ""
    offset: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class TensorHandle:
    """A tensor by reference; exactly one location is set."""

    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    cuda_ipc: CudaIpcLocation | None = None
    shared_memory: SharedMemoryLocation | None = None
    inline_bytes: bytes | None = None

    def __post_init__(self) -> None:
        locations = (self.cuda_ipc, self.shared_memory, self.inline_bytes)
        if sum(loc is not None for loc in locations) != 1:
            raise ValueError("a TensorHandle needs exactly one location")


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One multimodal item filling placeholder tokens of the prompt."""

    modality: str = "image"
    offset: int = 0
    length: int = 0
    content_hash: str = ""
    tensor: TensorHandle | None = None
    grid_thw: list[int] = field(default_factory=list)  # Qwen2-VL: (t, h, w) patches


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter a request runs with: vLLM's `LoRARequest(lora_name, lora_int_id,
    lora_path)`. `lora_int_id` (> 0) is the workers' cache key, unique per adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRARequest needs a lora_name")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, not {self.lora_int_id!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """A tokenized request, as the gateway sends it to the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str = ""
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    pooling_params: PoolingParams | None = None  # set: an embedding request (prefill only)
    lora_request: LoRARequest | None = None  # None: the base model
    trace_headers: dict[str, str] = field(default_factory=dict)  # W3C trace context; {}: none


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one position."""

    token_id: int = 0
    logprob: float = 0.0
    rank: int = 0
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def ranked(self) -> dict[int, tuple[float, int]]:
        """{token id: (logprob, rank)}: the chosen token first with its own rank, then the
        top-k ranked 1..k, each token once (vLLM's order)."""
        out = {self.token_id: (self.logprob, self.rank)}
        for rank, (token_id, logprob) in enumerate(
            zip(self.top_token_ids, self.top_logprobs, strict=True), start=1
        ):
            out.setdefault(token_id, (logprob, rank))
        return out


@dataclass(slots=True)
class RequestTimestamps:
    """Milestones of a request in unix seconds (0: not yet)."""

    queued: float = 0.0
    scheduled: float = 0.0
    first_token: float = 0.0


@dataclass(slots=True)
class EngineCoreOutput:
    """One update of one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    timestamps: RequestTimestamps = field(default_factory=RequestTimestamps)
    error: str = ""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    pooling_output: bytes = b""  # an embedding request's vector, little-endian float32

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.UNSPECIFIED
