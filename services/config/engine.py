"""The engine's configs: the model, the KV cache, speculative decoding, the scheduler and the
worker with its tensor parallelism."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Literal

from services.config.common import (
    BYTES,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MODEL,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATIONS,
    RUNNERS,
    SERVED_MODEL_NAME,
    GiB,
    Runner,
    _require,
)
from services.flags import Flag, flag
from services.lora_config import LoRAConfig


@dataclass(frozen=True)
class HubConfig:
    """Where a model named by a Hugging Face Hub id ("org/name") comes from."""

    revision: str = flag("", "Branch, tag or commit of a Hub model id; empty: main.")
    download_dir: str = flag(
        "", "Hugging Face cache for Hub models; empty: HF_HUB_CACHE, else HF_HOME's hub/."
    )


@dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and in what precision."""

    model: str = MODEL.field()
    served_model_name: str = SERVED_MODEL_NAME.field()
    dtype: Literal["bfloat16", "float32", "float16"] = flag(
        "bfloat16", "Weights and activations: bfloat16 (fast) or float32 (exact)."
    )
    bf16_gemm: Literal["auto", "native", "float32"] = flag(
        "auto",
        "CPU bf16 GEMMs: native bf16 kernels, float32 over upcast weights (same values, several "
        "times faster where the CPU lacks bf16 instructions), or auto: native when the CPU has "
        "AVX512-BF16/AMX, else float32.",
    )
    hf_exact_numerics: bool = flag(
        False,
        "CPU bf16: HF's own bf16 GEMMs and decode attention, bit for bit (slower: no GQA "
        "folding, no C++ decode kernel); the bf16 parity test turns it on.",
    )
    deterministic: bool = flag(
        False,
        "Batch-invariant mode (vLLM's VLLM_BATCH_INVARIANT): each request's output, bit for "
        "bit, independent of what it is batched with, of chunked prefill and of prefix-cache "
        "hits (fixed-shape GEMM tiles, per-token attention with fixed KV splits). CPU only; "
        "costs speed (docs/features.md).",
    )
    max_model_len: int = flag(0, "Longest prompt + output; 0: the model's max_position_embeddings.")
    device: str = flag("auto", "auto (cuda when available, else cpu), cpu or cuda[:N].")
    seed: int = flag(0, "Seed of the generator unseeded requests share.")
    # Revision and cache of a Hub id.
    hub: HubConfig = field(default_factory=HubConfig)
    # What the model runs as (vLLM's --runner): "generate" (completions, chat) or "pooling"
    # (embeddings: prefill-only requests pooled per the model's sentence-transformers files).
    runner: Runner = "generate"
    quantization: str = flag(
        "none",
        "Weights: none (as the checkpoint has them: a .gguf --model, an AWQ or GPTQ checkpoint "
        "is served in its own 4-bit weights), int8 / int4 (quantized at load to Q8_0 / Q4_1 "
        "blocks, int4 group-wise asymmetric), gguf (the default model's GGUF file as shipped), "
        "awq / gptq (the checkpoint must be one).",
        short="-q",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = flag(
        32,
        "int4: consecutive weights of a row sharing a scale and an offset (AWQ/GPTQ: the file's).",
        choices=QUANTIZATION_GROUP_SIZES,
    )

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
        _require(
            not (self.deterministic and self.hf_exact_numerics),
            "deterministic needs Tessera's CPU attention kernel, which hf_exact_numerics turns off",
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

    block_size: int = flag(16, "Tokens per KV block; the unit of allocation and of prefix caching.")
    enable_prefix_caching: bool = flag(
        True,
        "Prefix caching: reuse the KV blocks of identical prefixes across requests (the flag: off).",
        name="--no-prefix-caching",
    )
    kv_cache_memory_bytes: int = flag(
        2 * GiB,
        "CPU: bytes the KV pool may take, e.g. 2GiB or 512MiB (checked against free RAM; tessera "
        "serve splits it evenly over data-parallel replicas).",
        name="--kv-cache-memory",
        **BYTES,
    )
    gpu_memory_utilization: float = flag(
        0.9, "GPU: fraction of device memory for weights, activations and the KV pool."
    )
    num_blocks_override: int = flag(
        0,
        "Force the KV pool size in blocks (0: decided by the memory handshake).",
        name="--num-blocks",
    )
    cache_dtype: str = flag(
        "auto",
        "KV cache element type (vLLM's --kv-cache-dtype): auto (the model dtype), int8 or "
        "fp8_e4m3 (fp8): 8-bit K/V with a float16 scale per token and KV head, ~1.9x the blocks "
        "in the same memory.",
        name="--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
    )

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


SCHEDULER_CACHE_FIELDS = ("enable_prefix_caching", "num_blocks_override")  # the rest: workers'
SPECULATIVE = Flag(
    None,
    'Speculative decoding as JSON (vLLM\'s --speculative-config), e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\'; empty: off. '
    "On, the scheduler schedules the drafts the workers propose and steps run synchronously.",
    parse=SpeculativeConfig.parse,
    show=SpeculativeConfig.to_json,
)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and policy."""

    max_num_seqs: int = MAX_NUM_SEQS.field()
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS.field()
    long_prefill_token_threshold: int = flag(
        0, "Cap on one prompt's chunk per step; 0: only the step budget caps it."
    )
    enable_chunked_prefill: bool = flag(
        True,
        "Chunked prefill: a prompt longer than the budget left is split across steps (the "
        "flag: a prompt is admitted only when it fits the step budget whole).",
        name="--no-chunked-prefill",
    )
    policy: Literal["fcfs", "priority"] = flag(
        "fcfs", "Waiting-queue order: fcfs (arrival) or priority (priority, then arrival)."
    )
    async_scheduling: bool = flag(
        True,
        "Schedule step n+1 while the workers run step n (vLLM's async scheduling); the flag "
        "schedules each step only after the previous one's output is back.",
        name="--no-async-scheduling",
    )
    max_num_encoder_tokens: int = flag(
        0,
        "Image placeholder tokens the workers may encode in one step (bounds the vision-encoder "
        "time of a step); 0: the step's token budget.",
    )
    target_tpot_ms: float = flag(
        0.0,
        "Time per output token to aim for: a step that carries decodes gets only the prefill "
        "tokens that keep it within this many ms, from step times learned online (at least 64; "
        "--max-num-batched-tokens stays the cap); 0: every step may fill the cap.",
    )
    speculative_config: SpeculativeConfig | None = SPECULATIVE.field()  # noqa: RUF009
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
        _require(self.target_tpot_ms >= 0, "target_tpot_ms must be >= 0")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism of one worker: N ranks joined with torch.distributed."""

    tensor_parallel_size: int = flag(
        1, "Ranks the model is split over (heads and MLP columns); 1: no split."
    )
    init_method: str = flag(
        "",
        "Where ranks started by hand meet (with --tp-no-spawn on rank 0, and on ranks R > 0): "
        "tcp://HOST:PORT, a store rank 0 serves behind the internal token; empty: "
        "MASTER_ADDR/MASTER_PORT. Ranks rank 0 starts itself meet through a private file.",
        name="--tp-init-method",
    )
    spawn_ranks: bool = flag(
        True,
        "Rank 0 starts ranks 1..N-1 as local processes (the flag: they run elsewhere).",
        name="--tp-no-spawn",
    )
    enable_expert_parallel: bool = flag(
        False,
        "MoE: split the experts over the ranks by expert id rather than each expert's "
        "intermediate columns (vLLM's name); attention stays tensor parallel.",
    )

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")


@dataclass(frozen=True)
class WorkerConfig:
    """One model runner process."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    attention_backend: Literal["auto", "triton", "cpu", "reference"] = flag(
        "auto",
        "Attention implementation: auto (triton on CUDA, cpu otherwise), triton, cpu or reference.",
    )
    num_threads: int = flag(0, "Torch intra-op CPU threads; 0: all cores.")
    fused_decode_rows: int = flag(
        -1,
        "CPU: decode steps of up to this many requests run every decoder layer in one native "
        "call (no torch dispatch per op); -1: by weight format (256 dense with oneDNN's GEMM, 8 without, "
        "64 dense on AMX CPUs, 64 GGUF blocks), 0: off.",
    )
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS.field()
    max_num_seqs: int = MAX_NUM_SEQS.field()
    # Tensor parallelism (rank 0 is the worker the scheduler talks to).
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = SPECULATIVE.field()  # noqa: RUF009
    # Multi-LoRA: adapter slots and the largest rank.
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        _require(
            self.attention_backend in ("auto", "triton", "cpu", "reference"),
            f"unknown attention backend {self.attention_backend!r}",
        )
        _require(self.num_threads >= 0, "num_threads must be >= 0")
        _require(self.fused_decode_rows >= -1, "fused_decode_rows must be >= -1 (-1: auto)")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(
            not (self.lora.enable_lora and self.parallel.tensor_parallel_size > 1),
            "LoRA with tensor_parallel_size > 1 is not supported yet",
        )
        _require(
            not self.model.deterministic or self._batch_invariant_parts(),
            "deterministic is not supported with LoRA adapters, an int8 KV cache (its "
            "rotation) or the triton attention backend yet",
        )

    def _batch_invariant_parts(self) -> bool:
        """Whether every part that --deterministic cannot make batch-invariant yet is off."""
        return not (
            self.lora.enable_lora
            or self.cache.cache_dtype == "int8"
            or self.attention_backend == "triton"
        )
