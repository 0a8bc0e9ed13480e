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
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
    parse_bytes,
)
from services.default_model import resolve_model
from services.types import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    MultiModalInput,
    SamplingParams,
)
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


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class _Pending:
    """Tokens gathered for one request while the engine runs."""

    token_ids: list[int] = field(default_factory=list)
    last: EngineCoreOutput | None = None


class LLM:
    """Batch generation with Tessera's engine in this process."""

    def __init__(
        self,
        model: str = "default",
        *,
        dtype: str = "bfloat16",
        max_model_len: int = 0,
        block_size: int = 16,
        kv_cache_memory: str | int = "2GiB",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        num_threads: int = 0,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int = 0,
    ) -> None:
        from worker_service.worker import Worker  # torch comes in with the worker only

        lora = LoRAConfig(enable_lora, max_loras, max_lora_rank, max_cpu_loras)
        cache = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=parse_bytes(kv_cache_memory),
        )
        worker_config = WorkerConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed),  # type: ignore[arg-type]
            cache=cache,
            attention_backend=attention_backend,  # type: ignore[arg-type]
            num_threads=num_threads,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            lora=lora,
        )
        self.worker = Worker(worker_config)  # tensor parallel: starts ranks 1..N-1
        scheduler = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, lora=lora
        )
        self.engine = EngineCore(scheduler, cache, [self.worker])
        self.tokenizer = Tokenizer.load(model)
        self.mm_processor = MultiModalProcessor.load(resolve_model(model))  # None: text-only
        self.image_limits = ImageLimits()
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
                self._check(prompt_ids, params[i], i, loras[i])
            return self._run(images.ids, texts, params, use_tqdm, images.mm_inputs, loras)

    def chat(
        self,
        messages: Sequence[ChatTurn] | Sequence[Sequence[ChatTurn]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them, with the model's chat template."""
        chats = [messages] if messages and isinstance(messages[0], dict) else messages
        with _Images() as images:
            texts: list[str | None] = []
            for chat in chats:
                turns, pil_images = chat_images(list(chat), self.image_limits)  # type: ignore[arg-type]
                text = self.tokenizer.render_chat(turns)
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
            self._add(ids, p, items, lora)
            for ids, p, items, lora in zip(prompt_ids, params, mm, adapters, strict=True)
        ]
        pending = {rid: _Pending() for rid in request_ids}
        show = use_tqdm if use_tqdm is not None else len(request_ids) >= TQDM_MIN_PROMPTS
        with tqdm(total=len(request_ids), desc="generating", disable=not show) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    bar.update(_collect(pending[out.request_id], out))
        return [
            self._result(rid, ids, text, pending[rid])
            for rid, ids, text in zip(request_ids, prompt_ids, texts, strict=True)
        ]

    def _check(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        index: int,
        lora: LoRARequest | None = None,
    ) -> None:
        """The engine's own validation, before anything is queued; names the prompt."""
        try:
            self.engine.validate(
                EngineCoreRequest(str(index), prompt_ids, params, lora_request=lora)
            )
        except ValueError as exc:
            raise ValueError(f"prompt {index}: {exc}") from None

    def _add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        mm_inputs: list[MultiModalInput],
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
                lora_request=lora,
            )
        )
        return request_id

    def _result(
        self, request_id: str, prompt_ids: list[int], text: str | None, got: _Pending
    ) -> RequestOutput:
        last = got.last
        assert last is not None and last.finished, f"request {request_id} did not finish"
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(got.token_ids),
            token_ids=got.token_ids,
            finish_reason=FinishReason(last.finish_reason).openai_name,
            stop_reason=last.stop_reason,
            error=last.error,
        )
        return RequestOutput(request_id, text, prompt_ids, [completion], last.num_cached_tokens)

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
    pending.last = out
    return 1 if out.finished else 0


def _loras_per_prompt(lora: Any, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} lora requests for {n} prompts")
    return list(lora)


def _per_prompt(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
