"""Frozen configuration dataclasses, validated on construction.

One dataclass per concern; a service builds the ones it needs from its command
line and passes them down whole. Nothing here reads the environment.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
from dataclasses import dataclass, field, fields
from typing import Literal

from services.lora_config import LoRAConfig
from services.types import MAX_LOGPROBS, MAX_N

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # gateway.reasoning
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")  # gateway.tool_parsers
DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct (services.default_model)
GiB = 1 << 30

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bytes(text: str | int) -> int:
    """Parse a size such as 4GiB, 512MiB, 2G or 1073741824 into bytes.
    A bare number below 1024 is read as GiB (`--kv-cache-memory 4` means 4 GiB)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (try 4GiB, 512MiB or a byte count)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if not unit:
        return int(number * GiB) if number < 1024 else int(number)
    base = 1024 if "i" in unit else 1000
    power = "bkmgt".index(unit[0]) if unit[0] != "b" else 0
    return int(number * base**power) if unit[0] != "b" else int(number)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_network(text: str) -> bool:
    """Whether `text` is an IP network such as 10.0.0.0/8 or fd00::/8 (or one address)."""
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


Runner = Literal["generate", "pooling"]
RUNNERS: tuple[Runner, ...] = ("generate", "pooling")
TASKS = {"generate": "generate", "embed": "pooling", "embedding": "pooling"}  # --task aliases


def resolve_runner(runner: str | None, task: str | None) -> Runner:
    """The runner from vLLM's `--runner` or its older `--task` (embed -> pooling); both given
    must agree. ValueError for an unknown name."""
    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
    from_task = TASKS[task] if task is not None else None
    if runner is not None and from_task is not None and runner != from_task:
        raise ValueError(f"runner {runner!r} contradicts task {task!r}")
    chosen = runner or from_task or "generate"
    for known in RUNNERS:
        if chosen == known:
            return known
    raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, not {chosen!r}")


@dataclass(frozen=True)
class HubConfig:
    """Where a model named by a Hugging Face Hub id ("org/name") comes from."""

    # Branch, tag or commit of the Hub repository; empty: "main".
    revision: str = ""
    # The Hugging Face cache to look in and download into; empty: HF_HUB_CACHE / HF_HOME's.
    download_dir: str = ""


QUANTIZATIONS = ("none", "int8", "int4", "gguf", "awq", "gptq")  # ModelConfig.quantization
QUANTIZATION_GROUP_SIZES = (32, 64, 128)  # ModelConfig.quantization_group_size (int4)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and in what precision."""

    # HF directory, Hub id ("org/name"), or "default" for the embedded SmolLM2-135M-Instruct.
    model: str = DEFAULT_MODEL
    # Name the API serves it under; empty means derived from the directory.
    served_model_name: str = ""
    # Weight and activation dtype; bfloat16 is the fast default, float32 the exact one.
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    # How bf16 GEMMs run on CPU: "native" bf16 kernels, "float32" GEMMs over upcast
    # weights (same values, several times faster where the CPU lacks bf16 instructions),
    # or "auto": native when the CPU has AVX512-BF16/AMX, else float32.
    bf16_gemm: Literal["auto", "native", "float32"] = "auto"
    # Bit-for-bit HF bf16 numerics on CPU: HF's own bf16 GEMMs and decode attention call
    # (no GQA folding, no C++ decode kernel). Slower; the bf16 parity test turns it on.
    hf_exact_numerics: bool = False
    # Longest prompt + output; 0 means the model's own max_position_embeddings.
    max_model_len: int = 0
    # "auto" picks cuda when available, else cpu.
    device: str = "auto"
    # Seed for anything random at start (not per-request sampling).
    seed: int = 0
    # Revision and cache of a Hub id.
    hub: HubConfig = field(default_factory=HubConfig)
    # What the model runs as (vLLM's --runner): "generate" (completions, chat) or "pooling"
    # (embeddings: prefill-only requests pooled per the model's sentence-transformers files).
    runner: Runner = "generate"
    # Weights: "none" (as the checkpoint has them: a GGUF file is always read in its blocks,
    # an AWQ/GPTQ checkpoint by its config.json quantization_config), "int8" (quantized at
    # load, Q8_0 blocks), "int4" (quantized at load, group-wise asymmetric, Q4_1 blocks),
    # "gguf" (the default model's GGUF as shipped), "awq" / "gptq" (the checkpoint must be one).
    quantization: str = "none"
    # int4: weights of a row sharing one scale and offset (32, 64 or 128; AWQ/GPTQ: the file's).
    quantization_group_size: int = 32

    def __post_init__(self) -> None:
        _require(bool(self.model), "model must name a directory or 'default'")
        _require(
            self.quantization in QUANTIZATIONS,
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}",
        )
        _require(
            self.quantization_group_size in QUANTIZATION_GROUP_SIZES,
            f"quantization_group_size must be 32, 64 or 128, not {self.quantization_group_size}",
        )
        _require(
            self.quantization_group_size == 32 or self.quantization == "int4",
            "quantization_group_size applies to quantization int4 only",
        )
        _require(
            self.runner in RUNNERS,
            f"runner must be one of {', '.join(RUNNERS)}, not {self.runner!r}",
        )
        _require(self.dtype in ("bfloat16", "float32", "float16"), f"unknown dtype {self.dtype!r}")
        _require(
            self.bf16_gemm in ("auto", "native", "float32"),
            f"bf16_gemm must be auto, native or float32, not {self.bf16_gemm!r}",
        )
        _require(
            not (self.hf_exact_numerics and self.bf16_gemm == "float32"),
            "hf_exact_numerics needs HF's native bf16 GEMMs, not bf16_gemm=float32",
        )
        _require(self.max_model_len >= 0, "max_model_len must be >= 0 (0: the model's own)")
        _require(
            self.device == "auto" or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            f"device must be auto, cpu or cuda[:N], not {self.device!r}",
        )


# --kv-cache-dtype: "auto" keeps K/V in the model dtype; the others store each token's K and V
# per KV head as 8-bit values with one float16 scale (worker_service.attention.kv_quant).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")  # "fp8" is fp8_e4m3, as in vLLM


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    # Tokens per KV block; the unit of allocation and of prefix caching.
    block_size: int = 16
    # Reuse KV blocks of identical prefixes across requests.
    enable_prefix_caching: bool = True
    # CPU: bytes the KV pool may take (checked against free RAM).
    kv_cache_memory_bytes: int = 2 * GiB
    # GPU: fraction of device memory for weights + activations + KV pool.
    gpu_memory_utilization: float = 0.9
    # Force the number of blocks (tests); 0 means decided by the memory handshake.
    num_blocks_override: int = 0
    # vLLM's --kv-cache-dtype: one of KV_CACHE_DTYPES ("fp8" is stored as "fp8_e4m3").
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size must be 1..128, a power of 2",
        )
        _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes must be > 0")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        _require(self.num_blocks_override >= 0, "num_blocks_override must be >= 0")
        _require(
            self.cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.cache_dtype!r}",
        )
        if self.cache_dtype == "fp8":
            object.__setattr__(self, "cache_dtype", "fp8_e4m3")


SPECULATIVE_METHODS = ("ngram", "draft_model")
_LOOKUP_DEFAULT = 5  # vLLM's n-gram size when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config`): the worker proposes up to
    `num_speculative_tokens` draft tokens per request after sampling; the next step verifies
    them in one forward and keeps the longest prefix the rejection sampler accepts."""

    # "ngram": prompt lookup over the request's own tokens (no extra model);
    # "draft_model": a small model with the same tokenizer proposes.
    method: Literal["ngram", "draft_model"] = "ngram"
    # K, the most draft tokens verified per request and step.
    num_speculative_tokens: int = 4
    # ngram: shortest and longest suffix looked up earlier in the request's tokens; 0 = unset:
    # as vLLM, one given stands for both, neither means 5.
    prompt_lookup_min: int = 0
    # ngram: the longest suffix looked up (see prompt_lookup_min).
    prompt_lookup_max: int = 0
    # draft_model: the draft model's HF directory.
    model: str = ""

    def __post_init__(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        object.__setattr__(self, "prompt_lookup_min", low or high or _LOOKUP_DEFAULT)
        object.__setattr__(self, "prompt_lookup_max", high or low or _LOOKUP_DEFAULT)
        _require(
            self.method in SPECULATIVE_METHODS,
            f"speculative method must be one of {SPECULATIVE_METHODS}, not {self.method!r}",
        )
        _require(
            1 <= self.num_speculative_tokens <= 32, "num_speculative_tokens must be in [1, 32]"
        )
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "need 1 <= prompt_lookup_min <= prompt_lookup_max",
        )
        _require(
            (self.method == "draft_model") == bool(self.model),
            'a "model" is given with method "draft_model" and only then',
        )

    @classmethod
    def parse(
        cls, value: str | dict[str, object] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """From the JSON of `--speculative-config` or an `LLM(speculative_config=...)` dict;
        None / "" stay None (speculation off). ValueError on unknown keys or bad values."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        _require(not unknown, f"unknown speculative config keys: {unknown}")
        return cls(**value)  # type: ignore[arg-type]

    def to_json(self) -> str:
        """The flag value that parses back to this config."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    """vLLM's --kv-cache-dtype (CacheConfig.cache_dtype), for the worker and `tessera serve`."""
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache element type: auto (the model dtype), int8 or fp8_e4m3 (fp8): 8-bit "
        "K/V with a float16 scale per token and KV head, ~1.9x the blocks in the same memory",
    )


def add_speculative_arg(p: argparse.ArgumentParser) -> None:
    """vLLM's --speculative-config (services.config.SpeculativeConfig), a JSON object."""
    p.add_argument(
        "--speculative-config",
        default="",
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": '
        '4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (default: off)',
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and policy."""

    # Most requests in one step (the running set's cap).
    max_num_seqs: int = 256
    # Token budget of one step: decode tokens plus prefill chunks.
    max_num_batched_tokens: int = 2048
    # A single prefill chunk takes at most this many tokens; 0 means no cap below the budget.
    long_prefill_token_threshold: int = 0
    # Chunked prefill: a prompt longer than the remaining budget is split across steps.
    enable_chunked_prefill: bool = True
    # "fcfs" serves in arrival order; "priority" by (priority, arrival).
    policy: Literal["fcfs", "priority"] = "fcfs"
    # Schedule step n+1 while the workers run step n (vLLM's async scheduling): the worker
    # never waits for the scheduler; off runs schedule -> execute -> update in turn.
    async_scheduling: bool = True
    # Multimodal placeholder tokens (image embeddings) the workers may encode in one step;
    # 0 means max_num_batched_tokens. Bounds the vision-encoder time of a step.
    max_num_encoder_tokens: int = 0
    # Speculative decoding: the scheduler schedules the drafts the workers propose. On, steps
    # run synchronously (a step's drafts depend on the output of the step before).
    speculative_config: SpeculativeConfig | None = None
    # Multi-LoRA: at most lora.max_loras distinct adapters in the running batch.
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def encoder_budget(self) -> int:
        return self.max_num_encoder_tokens or self.max_num_batched_tokens

    @property
    def use_async_scheduling(self) -> bool:
        """Async scheduling as asked, unless speculation needs each step's output first."""
        return self.async_scheduling and self.speculative_config is None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(self.max_num_encoder_tokens >= 0, "max_num_encoder_tokens must be >= 0")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(
            self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0"
        )
        _require(self.policy in ("fcfs", "priority"), f"unknown policy {self.policy!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism of one worker: N ranks joined with torch.distributed."""

    # Ranks the model is split over (heads and MLP columns); 1 means no split.
    tensor_parallel_size: int = 1
    # Where ranks started by hand (spawn_ranks off) meet: tcp://HOST:PORT, a store rank 0
    # serves there behind the internal token; empty: MASTER_ADDR/MASTER_PORT. Ranks rank 0
    # starts itself meet through a private file instead, so this must then stay empty.
    init_method: str = ""
    # Rank 0 starts ranks 1..N-1 as local processes; off when they run elsewhere.
    spawn_ranks: bool = True
    # MoE experts split over the ranks by expert id (whole experts) rather than each
    # expert's intermediate columns (vLLM's --enable-expert-parallel); attention stays TP.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")


@dataclass(frozen=True)
class WorkerConfig:
    """One model runner process."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # Attention implementation: auto (triton on CUDA, cpu otherwise), triton, cpu or reference.
    attention_backend: Literal["auto", "triton", "cpu", "reference"] = "auto"
    # Intra-op threads for torch on CPU; 0 means all cores.
    num_threads: int = 0
    # Largest batch the runner prepares for (profiling on GPU, buffers on CPU).
    max_num_batched_tokens: int = 2048
    # Most requests in one step.
    max_num_seqs: int = 256
    # Tensor parallelism (rank 0 is the worker the scheduler talks to).
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Speculative decoding: how drafts are proposed after sampling; None: off.
    speculative_config: SpeculativeConfig | None = None
    # Multi-LoRA: adapter slots and the largest rank.
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        _require(
            self.attention_backend in ("auto", "triton", "cpu", "reference"),
            f"unknown attention backend {self.attention_backend!r}",
        )
        _require(self.num_threads >= 0, "num_threads must be >= 0")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(
            not (self.lora.enable_lora and self.parallel.tensor_parallel_size > 1),
            "LoRA with tensor_parallel_size > 1 is not supported yet",
        )


ROUTINGS = ("affinity", "round-robin")  # how a gateway spreads requests over engine replicas


@dataclass(frozen=True)
class RequestLimits:
    """What one generate request may ask for (REST and gRPC); over a limit: 400 /
    INVALID_ARGUMENT before any engine work, past the deadline: 408 / DEADLINE_EXCEEDED."""

    # Most choices (`n`) per request, at most MAX_N.
    max_n: int = 16
    # Most top logprobs per token (`logprobs` / `top_logprobs`), at most MAX_LOGPROBS.
    max_logprobs: int = MAX_LOGPROBS
    # Most tokens one request may generate over all its choices and prompts: the sum of
    # max_tokens (unset: the context left after the prompt) x n; 0 means no cap.
    max_request_tokens: int = 262144
    # Seconds a request may take before it is aborted; 0 means no server deadline. A
    # request's own `timeout` (REST) or call deadline (gRPC) wins when shorter.
    request_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        _require(1 <= self.max_n <= MAX_N, f"max_n must be in [1, {MAX_N}]")
        _require(
            0 <= self.max_logprobs <= MAX_LOGPROBS, f"max_logprobs must be in [0, {MAX_LOGPROBS}]"
        )
        _require(self.max_request_tokens >= 0, "max_request_tokens must be >= 0 (0: no cap)")
        _require(self.request_timeout_s >= 0, "request_timeout_s must be >= 0 (0: none)")

    def timeout_s(self, requested_s: float | None) -> float | None:
        """The deadline of a request that asked for `requested_s` (None: it did not): the
        shorter of that and the server's; None when neither sets one."""
        given = [t for t in (self.request_timeout_s, requested_s) if t]
        return min(given) if given else None


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI REST front end and the public gRPC text API."""

    # Address of the scheduler's EngineCore service.
    scheduler_address: str = "127.0.0.1:50051"
    # Model directory or Hub id for the tokenizer and chat template ("default": embedded).
    model: str = DEFAULT_MODEL
    # Revision and cache of a Hub id.
    hub: HubConfig = field(default_factory=HubConfig)
    # Name clients must use in "model"; empty means what the scheduler reports.
    served_model_name: str = ""
    # Address the HTTP and gRPC text APIs listen on.
    host: str = "127.0.0.1"
    # HTTP port of the OpenAI API.
    port: int = 8000
    # Port of the TextGeneration gRPC API; 0 disables it.
    grpc_port: int = 50052
    # Bearer token clients must send; empty means no auth.
    api_key: str = ""
    # Requests in flight at once before new ones get 429.
    max_queued_requests: int = 1024
    # Origins allowed by CORS; empty means CORS off.
    cors_allow_origins: tuple[str, ...] = ()
    # Largest request body accepted, in bytes; also the gRPC text API's largest message.
    max_body_bytes: int = 32 << 20
    # Bytes of request bodies / messages held at once across all requests (REST and gRPC);
    # past it new ones get 429 / RESOURCE_EXHAUSTED. Bounds memory under concurrent large input.
    max_inflight_bytes: int = 256 << 20
    # Seconds in-flight streams may take to finish on SIGTERM.
    drain_timeout_s: float = 30.0
    # Further EngineCore addresses: data-parallel engine replicas beside scheduler_address.
    extra_scheduler_addresses: tuple[str, ...] = ()
    # How requests spread over replicas: "affinity" (prefix hash, bounded by load) or
    # "round-robin".
    routing: str = "affinity"
    # Images one prompt may carry (vision-language models); more get 400.
    limit_images_per_prompt: int = 8
    # Largest encoded image, in bytes, and largest width * height: a bound on decode cost.
    max_image_bytes: int = 20 << 20
    # Largest decoded image, width * height.
    max_image_pixels: int = 4096 * 4096
    # Hosts http(s) image URLs may come from (and their subdomains); empty: remote URLs off.
    allowed_media_domains: tuple[str, ...] = ()
    # Seconds one remote image fetch may take in all: resolving, connecting and the body.
    media_fetch_timeout_s: float = 10.0
    # Longest side / shortest side an image may have; past it 400 (HF processors keep the
    # aspect ratio when resizing, so a 400000x1 image would cost gigabytes).
    max_image_aspect_ratio: float = 200.0
    # Networks (CIDR) remote image hosts may resolve into although they are loopback,
    # private, link-local or otherwise not global; empty: only global unicast addresses.
    allowed_media_networks: tuple[str, ...] = ()
    # How pixels reach the worker: "auto" (shm when the worker reports this host, else
    # inline bytes), or always "shm" / "inline" (benchmarks, unusual deployments).
    image_transport: Literal["auto", "shm", "inline"] = "auto"
    # Per-request budgets and deadline: --max-n, --max-logprobs, --max-request-tokens,
    # --request-timeout.
    limits: RequestLimits = field(default_factory=RequestLimits)
    # A Jinja chat template file used instead of the model's own; empty: the model's.
    chat_template: str = ""
    # How message content reaches the template: "string", "openai" (lists of parts) or
    # "auto" (openai when the template walks a message's content parts).
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    # Splits thinking into reasoning_content: "qwen3", "deepseek_r1"; empty: off.
    reasoning_parser: str = ""
    # Tool-call format of tool_choice "auto": one of TOOL_CALL_PARSERS; "auto" picks it from
    # the tokenizer (gateway.tool_parsers.detect).
    tool_call_parser: str = "auto"
    # Multi-LoRA: the adapters "model" may name, runtime load/unload.
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def scheduler_addresses(self) -> tuple[str, ...]:
        """Every EngineCore address given (one DNS name may stand for several replicas)."""
        return (self.scheduler_address, *self.extra_scheduler_addresses)

    def __post_init__(self) -> None:
        for address in self.scheduler_addresses:
            _require(":" in address, f"scheduler_address must be host:port, not {address!r}")
        _require(self.routing in ROUTINGS, f"routing must be one of {ROUTINGS}")
        for name in ("port", "grpc_port"):
            _require(0 <= getattr(self, name) <= 65535, f"{name} must be a TCP port")
        _require(self.max_queued_requests >= 1, "max_queued_requests must be >= 1")
        _require(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        _require(self.max_inflight_bytes >= 1024, "max_inflight_bytes must be >= 1024")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _require(self.limit_images_per_prompt >= 1, "limit_images_per_prompt must be >= 1")
        _require(min(self.max_image_bytes, self.max_image_pixels) >= 1, "image caps must be >= 1")
        _require(self.media_fetch_timeout_s > 0, "media_fetch_timeout_s must be > 0")
        _require(self.max_image_aspect_ratio >= 1, "max_image_aspect_ratio must be >= 1")
        for network in self.allowed_media_networks:
            _require(_is_network(network), f"allowed_media_networks: {network!r} is not a CIDR")
        _require(self.image_transport in ("auto", "shm", "inline"), "unknown image_transport")
        _require(
            self.chat_template_content_format in ("auto", "string", "openai"),
            "chat_template_content_format must be auto, string or openai",
        )
        _require(
            self.tool_call_parser in ("auto", *TOOL_CALL_PARSERS),
            f"tool_call_parser must be auto or one of {TOOL_CALL_PARSERS}",
        )
        _require(
            self.reasoning_parser in ("", *REASONING_PARSERS),
            f"reasoning_parser must be one of {REASONING_PARSERS}, not {self.reasoning_parser!r}",
        )


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call a gRPC service and over what transport (the server and its clients)."""

    # Shared secret callers send as `authorization: Bearer <token>`; empty: no token check.
    token: str = ""
    # PEM certificate chain of this process: its server identity and, with tls_ca, its client
    # identity for mutual TLS. Empty: plaintext (unless tls_ca alone makes a TLS client).
    tls_cert: str = ""
    # PEM private key of tls_cert.
    tls_key: str = ""
    # PEM CA bundle: servers then require client certificates it signed (mutual TLS);
    # clients verify the server's certificate with it.
    tls_ca: str = ""
    # Host name to check the server certificate against when it differs from the host dialled.
    tls_server_name: str = ""

    def __post_init__(self) -> None:
        _require(bool(self.tls_cert) == bool(self.tls_key), "tls_cert and tls_key go together")
        _require(not self.tls_server_name or self.tls, "tls_server_name needs tls_ca or tls_cert")

    @property
    def tls(self) -> bool:
        """True when connections use TLS."""
        return bool(self.tls_cert or self.tls_ca)
