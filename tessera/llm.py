"""The offline API: the same scheduler and model runner in one process, no gRPC.

from tessera import LLM, SamplingParams
llm = LLM()  # the embedded default model
outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from gateway.multimodal import ImageLimits, MultiModalProcessor, PreparedImages, chat_images
from gateway.tokenizer import ChatTurn, Tokenizer
from scheduler_service.engine import EngineCore
from services.config import (
    DEFAULT_MODEL,
    CacheConfig,
    HubConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
    parse_bytes,
    resolve_runner,
)
from services.default_model import resolve_model, served_name
from services.lora_config import LoRAConfig
from services.pooling import check_pooling_params, read_pooler_config
from services.step_types import SchedulerStats
from services.types import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    MultiModalInput,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)
from tessera.embed import EmbeddingRequestOutput, embedding_result
from tessera.logprobs import PositionLogprobs, position_logprobs, prompt_logprobs
from tessera.prompts import Prompt, parse_prompts

TQDM_MIN_PROMPTS = 16  # progress bar from this many prompts on, unless told otherwise


@dataclass
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    error: str = ""
    logprobs: list[PositionLogprobs] | None = None  # per output token, when asked


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # when asked; [0] is None


@dataclass
class _Pending:
    """Tokens gathered for one request while the engine runs."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: EngineCoreOutput | None = None


class LLM:
    """Batch generation with Tessera's engine in this process."""

    def __init__(
        self,
        model: str = "default",
        *,
        dtype: str = "bfloat16",
        quantization: str | None = None,
        quantization_group_size: int = 32,
        max_model_len: int = 0,
        block_size: int = 16,
        kv_cache_memory: str | int = "2GiB",
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        num_threads: int = 0,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        revision: str | None = None,
        download_dir: str | None = None,
        runner: str | None = None,
        task: str | None = None,
        speculative_config: dict[str, Any] | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int = 0,
        deterministic: bool = False,
    ) -> None:
        """`runner="pooling"` (or vLLM's older `task="embed"`) serves `embed`, not `generate`;
        `speculative_config`: vLLM's dict, e.g. {"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4};
        `quantization="int8"` / `"int4"` quantizes the weights at load (weight-only; int4 in
        groups of `quantization_group_size` = 32, 64 or 128 weights); an AWQ or GPTQ
        checkpoint is read as it is (its config.json's quantization_config).
        `kv_cache_dtype="int8"` / `"fp8_e4m3"` stores K/V in 8 bits with per-token, per-head
        scales (vLLM's --kv-cache-dtype). `deterministic=True`: batch-invariant kernels (vLLM's
        VLLM_BATCH_INVARIANT), a request's output independent of its batch, chunking and
        prefix-cache hits."""
        from worker_service.worker import Worker  # torch comes in with the worker only

        source = model
        model_dir = resolve_model(model, HubConfig(revision or "", download_dir or ""))
        if model != DEFAULT_MODEL:
            model = str(model_dir)  # a Hub id is looked up (or downloaded) once
        self.runner = resolve_runner(runner, task)
        spec = SpeculativeConfig.parse(speculative_config)

        lora = LoRAConfig(enable_lora, max_loras, max_lora_rank, max_cpu_loras)
        cache = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=parse_bytes(kv_cache_memory),
            cache_dtype=kv_cache_dtype,
        )
        worker_config = WorkerConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,  # type: ignore[arg-type]
                quantization=quantization or "none",
                quantization_group_size=quantization_group_size,
                max_model_len=max_model_len,
                seed=seed,
                runner=self.runner,
                deterministic=deterministic,
            ),
            cache=cache,
            attention_backend=attention_backend,  # type: ignore[arg-type]
            num_threads=num_threads,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                enable_expert_parallel=enable_expert_parallel,
            ),
            speculative_config=spec,
            lora=lora,
        )
        self.worker = Worker(worker_config)  # tensor parallel: starts ranks 1..N-1
        scheduler = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            speculative_config=spec,
            lora=lora,
        )
        self.engine = EngineCore(scheduler, cache, [self.worker])
        self.tokenizer = Tokenizer.load(model_dir)
        self.mm_processor = MultiModalProcessor.load(model_dir)  # None: text-only
        self.image_limits = ImageLimits()
        pooling = self.runner == "pooling"
        self.pooler_config = read_pooler_config(model_dir) if pooling else None
        self.model_name = served_name(source)
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs keep the prompts' order.

        A prompt is text, token ids, {"prompt": str} or {"prompt_token_ids": [...]}
        (vLLM's forms), one or a list. All are checked before any is queued.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt.
        """
        parsed = parse_prompts(prompts, self.tokenizer.encode)
        params = _per_prompt(sampling_params, len(parsed))
        loras = _loras_per_prompt(lora_request, len(parsed))
        texts = [p.text for p in parsed]
        with _Images() as images:
            for p in parsed:
                images.add(self._with_images(p.text or "", list(p.images), True), p.token_ids)
            for i, prompt_ids in enumerate(images.ids):
                self._check(prompt_ids, params[i], i, lora=loras[i])
            return self._run(images.ids, texts, params, use_tqdm, images.mm_inputs, loras)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One pooled vector per prompt (runner "pooling"), in the prompts' order; prompts as
        in `generate` (text or token ids). All are checked before any is queued."""
        if self.pooler_config is None:
            raise ValueError("LLM.embed needs runner='pooling' (or task='embed')")
        parsed = parse_prompts(prompts, self.tokenizer.encode)
        params = _per_prompt(pooling_params, len(parsed), PoolingParams)
        ids = [p.token_ids for p in parsed]
        for i, (prompt, p) in enumerate(zip(parsed, params, strict=True)):
            if prompt.images:
                raise ValueError(f"prompt {i}: embeddings take no images")
            try:
                check_pooling_params(p, self.pooler_config, self.model_name)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
            self._check(prompt.token_ids, SamplingParams(), i, p)
        request_ids = [
            self._add(t, SamplingParams(), [], p) for t, p in zip(ids, params, strict=True)
        ]
        pending = self._drain(request_ids, use_tqdm, "embedding")
        return [
            embedding_result(rid, t, pending[rid].last)
            for rid, t in zip(request_ids, ids, strict=True)
        ]

    def chat(
        self,
        messages: Sequence[ChatTurn] | Sequence[Sequence[ChatTurn]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them, with the model's chat template
        (`chat_template_kwargs`: extra template variables, e.g. {"enable_thinking": False})."""
        chats = [messages] if messages and isinstance(messages[0], dict) else messages
        with _Images() as images:
            texts: list[str | None] = []
            for chat in chats:
                turns, pil_images = chat_images(list(chat), self.image_limits)  # type: ignore[arg-type]
                text = self.tokenizer.render_chat(turns, template_kwargs=chat_template_kwargs)
                prepared = self._with_images(text, pil_images, False)
                images.add(prepared, [] if prepared else self.tokenizer.encode(text, False))
                texts.append(text)
            params = _per_prompt(sampling_params, len(images.ids))
            return self._run(images.ids, texts, params, use_tqdm, images.mm_inputs)

    def _with_images(
        self, text: str, images: list[Any], add_special_tokens: bool
    ) -> PreparedImages | None:
        """The model's processor over `text` and `images`; None when there are no images."""
        if not images:
            return None
        if self.mm_processor is None:
            raise ValueError("this model is text-only; it takes no images")
        return self.mm_processor.prepare(text, images, "shm", add_special_tokens)

    def _run(
        self,
        prompt_ids: list[list[int]],
        texts: list[str | None],
        params: list[SamplingParams],
        use_tqdm: bool | None,
        mm_inputs: list[list[MultiModalInput]] | None = None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        mm = mm_inputs or [[] for _ in prompt_ids]
        adapters = loras or [None] * len(prompt_ids)
        request_ids = [
            self._add(ids, p, items, lora=lora)
            for ids, p, items, lora in zip(prompt_ids, params, mm, adapters, strict=True)
        ]
        pending = self._drain(request_ids, use_tqdm, "generating")
        return [
            self._result(rid, ids, text, p, pending[rid])
            for rid, ids, text, p in zip(request_ids, prompt_ids, texts, params, strict=True)
        ]

    def _drain(
        self, request_ids: list[str], use_tqdm: bool | None, desc: str
    ) -> dict[str, _Pending]:
        """Step the engine until every request finished; what each produced."""
        pending = {rid: _Pending() for rid in request_ids}
        show = use_tqdm if use_tqdm is not None else len(request_ids) >= TQDM_MIN_PROMPTS
        with tqdm(total=len(request_ids), desc=desc, disable=not show) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    bar.update(_collect(pending[out.request_id], out))
        return pending

    def _check(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        index: int,
        pooling: PoolingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        """The engine's own validation, before anything is queued; names the prompt."""
        try:
            request = EngineCoreRequest(
                str(index), prompt_ids, params, pooling_params=pooling, lora_request=lora
            )
            self.engine.validate(request)
        except ValueError as exc:
            raise ValueError(f"prompt {index}: {exc}") from None

    def _add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        mm_inputs: list[MultiModalInput],
        pooling: PoolingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> str:
        request_id = str(self._next_id)
        self._next_id += 1
        self.engine.add_request(
            EngineCoreRequest(
                request_id,
                prompt_ids,
                params,
                arrival_time=time.time(),
                mm_inputs=mm_inputs,
                pooling_params=pooling,
                lora_request=lora,
            )
        )
        return request_id

    def _result(
        self,
        request_id: str,
        prompt_ids: list[int],
        text: str | None,
        params: SamplingParams,
        got: _Pending,
    ) -> RequestOutput:
        last = got.last
        assert last is not None and last.finished, f"request {request_id} did not finish"
        decode = self.tokenizer.token_text
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(got.token_ids),
            token_ids=got.token_ids,
            finish_reason=FinishReason(last.finish_reason).openai_name,
            stop_reason=last.stop_reason,
            error=last.error,
        )
        if params.logprobs is not None:
            completion.logprobs = [position_logprobs(e, decode) for e in got.logprobs]
        result = RequestOutput(request_id, text, prompt_ids, [completion], last.num_cached_tokens)
        if params.prompt_logprobs is not None:
            result.prompt_logprobs = prompt_logprobs(got.prompt_logprobs, decode)
        return result

    def stats(self) -> SchedulerStats:
        """The engine's counters: steps, preemptions, prefix cache, speculative decoding
        (spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Release the engine and the model."""
        self.engine.shutdown()
        self.worker.shutdown()
        self.tokenizer.close()


class _Images:
    """Token ids and mm_inputs of a batch of prompts; closes the image exports on exit."""

    def __init__(self) -> None:
        self.ids: list[list[int]] = []
        self.mm_inputs: list[list[MultiModalInput]] = []
        self.prepared: list[PreparedImages] = []

    def add(self, prepared: PreparedImages | None, token_ids: list[int]) -> None:
        if prepared is None:
            self.ids.append(token_ids)
            self.mm_inputs.append([])
            return
        self.prepared.append(prepared)
        self.ids.append(prepared.token_ids)
        self.mm_inputs.append(prepared.mm_inputs)

    def __enter__(self) -> _Images:
        return self

    def __exit__(self, *exc: object) -> None:
        for prepared in self.prepared:
            prepared.close()


def _collect(pending: _Pending, out: EngineCoreOutput) -> int:
    """Add one engine update; returns 1 when it finished the request."""
    pending.token_ids.extend(out.new_token_ids)
    pending.logprobs.extend(out.new_logprobs)
    pending.prompt_logprobs.extend(out.prompt_logprobs)
    pending.last = out
    return 1 if out.finished else 0


def _loras_per_prompt(lora: Any, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} lora requests for {n} prompts")
    return list(lora)


def _per_prompt(params: Any, n: int, kind: type = SamplingParams) -> list[Any]:
    """One params object per prompt: None (the defaults), one for all, or a list of n."""
    if params is None:
        return [kind()] * n
    if isinstance(params, kind):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} {kind.__name__} for {n} prompts")
    return list(params)
