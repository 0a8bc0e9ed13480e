"""The generate path shared by the REST API and the gRPC text API.

`Serving` owns the engine client, the tokenizer, admission (in-flight limit,
draining) and the served model's description. `Serving.generate(job)` runs the
n choices of every prompt as separate engine requests (`{id}-{index}`) and
yields their `ChoiceDelta`s interleaved; closing or cancelling the iterator
cancels every engine call, which aborts the requests in the scheduler. A job
over the token budget is refused before any engine call; one past its deadline
(`RequestLimits.timeout_s`) raises `RequestTimeout` after its engine calls are
cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.admission import ByteBudget
from gateway.errors import (
    EngineError,
    InvalidRequest,
    ModelNotFound,
    RequestTimeout,
    ServiceUnavailable,
    TooManyRequests,
)
from gateway.metrics import GatewayMetrics
from gateway.options import check_token_budget
from gateway.output import ChoiceDelta, OutputProcessor
from gateway.protocol import TextOptions
from gateway.router import EngineRouter
from gateway.tokenizer import Tokenizer
from gateway.tracing import RequestTrace, current_trace
from services.config import DEFAULT_MODEL, RequestLimits
from services.step_types import ServerInfo
from services.types import EngineCoreRequest, LoRARequest

if TYPE_CHECKING:
    from gateway.lora import LoRARegistry
    from gateway.media import ImageService
    from gateway.multimodal import PreparedImages


@dataclass(frozen=True)
class ModelCard:
    """The served model as clients see it."""

    name: str
    max_model_len: int
    vocab_size: int
    created: int
    host_id: str = ""  # the worker's host (services.tensor_handles.host_id): shm handles
    runner: str = "generate"  # "pooling": /v1/embeddings only; else completions and chat
    lora_request: LoRARequest | None = None  # the adapter `name` stands for; None: the base


@dataclass
class GenerateJob:
    """One client request: every prompt runs `options.n` times."""

    request_id: str
    prompts: list[list[int]]  # token ids per prompt
    options: TextOptions
    prompt_logprobs: bool = False  # echo with logprobs: ask for prompt logprobs too
    arrival_time: float = field(default_factory=time.time)
    images: PreparedImages | None = None  # the prompt's image handles, owned by the job
    lora_request: LoRARequest | None = None  # the adapter the request's model names
    trace: RequestTrace | None = field(default_factory=current_trace)  # None: untraced

    def release(self) -> None:
        """Free the job's image memory (unlink shm segments); once the request ended."""
        if self.images is not None:
            self.images.close()

    def choices(self) -> Iterator[tuple[int, list[int]]]:
        """(choice index, prompt ids): prompt p, sample j is choice p * n + j."""
        for p, prompt in enumerate(self.prompts):
            for j in range(self.options.n):
                yield p * self.options.n + j, prompt


_DONE = object()


class Serving:
    """Shared state and the generate path of one gateway."""

    def __init__(
        self,
        engine: EngineRouter,
        tokenizer: Tokenizer,
        metrics: GatewayMetrics,
        served_model_name: str = "",
        max_in_flight: int = 1024,
        max_inflight_bytes: int = 256 << 20,
        limits: RequestLimits | None = None,
        loras: LoRARegistry | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.byte_budget = ByteBudget(max_inflight_bytes)  # request bytes held, REST and gRPC
        self.limits = limits or RequestLimits()  # per-request budgets and deadline
        self.draining = False
        self.images: ImageService | None = None  # set for a vision-language model
        self.model_files = DEFAULT_MODEL  # the model's directory (pooling config, embeddings)
        self._card: ModelCard | None = None
        self.loras = loras  # served LoRA adapters (--enable-lora); None: none

    # -- model and admission ---------------------------------------------------------------

    async def model_card(self) -> ModelCard:
        """The served model (asks the scheduler once; 503 while it cannot be reached)."""
        if self._card is None:
            info: ServerInfo = await self.engine.server_info()
            name = self.served_model_name or info.model_name or "default"
            vocab = info.vocab_size or self.tokenizer.vocab_size
            created, runner = int(time.time()), info.runner or "generate"
            self._card = ModelCard(name, info.max_model_len, vocab, created, info.host_id, runner)
            self.metrics.bind_model(name, info.max_model_len)
            self.tokenizer.limit_tokens(info.max_model_len)
        return self._card

    async def check_model(self, model: str | None) -> ModelCard:
        """The card when `model` names the served model (or is empty) or one of its LoRA
        adapters (then the card carries the adapter); 404 otherwise."""
        card = await self.model_card()
        lora = self.loras.get(model) if self.loras is not None else None
        if lora is not None:
            return dataclasses.replace(card, name=lora.lora_name, lora_request=lora)
        if model and model != card.name:
            raise ModelNotFound(
                f"The model '{model}' does not exist; this server serves '{card.name}'.", "model"
            )
        return card

    @staticmethod
    def check_runner(card: ModelCard, wanted: str) -> None:
        """400 when the model runs as the other runner (embeddings of a generate model,
        completions of a pooling one)."""
        if card.runner == wanted:
            return
        if wanted == "pooling":
            raise InvalidRequest(
                f"The model '{card.name}' does not support embeddings: this server runs the "
                "generate runner (start it with --runner pooling)",
                "model",
            )
        raise InvalidRequest(
            f"The model '{card.name}' runs the pooling runner: this server serves "
            "/v1/embeddings only (start it with --runner generate for completions)",
            "model",
        )

    def acquire(self) -> None:
        """Count one request in flight; 503 while draining, 429 when the limit is full."""
        if self.draining:
            raise ServiceUnavailable("the server is shutting down")
        if self.in_flight >= self.max_in_flight:
            raise TooManyRequests(
                f"too many requests in flight (limit {self.max_in_flight}); retry later"
            )
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

    def release(self) -> None:
        """Undo one `acquire()`."""
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """`acquire()` for the duration of a block."""
        self.acquire()
        try:
            yield
        finally:
            self.release()

    # -- prompts -------------------------------------------------------------------------

    async def encode_prompt(self, prompt: str | list[int], vocab_size: int) -> list[int]:
        """Token ids of a text prompt, or checked ids of a token prompt."""
        if isinstance(prompt, str):
            return await self.tokenizer.encode_async(prompt)
        bad = [t for t in prompt if t >= vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})", "prompt"
            )
        return prompt

    # -- generation ----------------------------------------------------------------------

    async def generate(self, job: GenerateJob) -> AsyncGenerator[ChoiceDelta, None]:
        """Every choice's deltas, interleaved; each choice ends with a finish_reason. The
        job's images are released when this ends, however it ends."""
        try:
            async for delta in self._generate(job):
                yield delta
        finally:
            job.release()

    async def _generate(self, job: GenerateJob) -> AsyncGenerator[ChoiceDelta, None]:
        card = await self.model_card()
        if job.trace is not None:
            job.trace.describe(job, job.lora_request.lora_name if job.lora_request else card.name)
        requests = [self._engine_request(job, i, prompt, card) for i, prompt in job.choices()]
        check_token_budget([r.sampling_params.max_tokens or 0 for _, r in requests], self.limits)
        deadline = _Deadline(self.limits.timeout_s(job.options.timeout_s), job.arrival_time)
        queue: asyncio.Queue[object] = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(job, i, r, queue)) for i, r in requests]
        try:
            remaining = len(tasks)
            while remaining:
                item = await self._next(queue, deadline)
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    assert isinstance(item, ChoiceDelta)
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _next(self, queue: asyncio.Queue[object], deadline: _Deadline) -> object:
        """The next item of `queue`; RequestTimeout once `deadline` passed."""
        if deadline.at is None:  # no deadline: no timer per token
            return await queue.get()
        try:
            async with asyncio.timeout_at(deadline.at):
                if deadline.passed():  # checked here too: a queue never empty never blocks
                    raise TimeoutError
                return await queue.get()
        except TimeoutError:
            self.metrics.timeouts.inc()
            raise RequestTimeout(
                f"the request ran past its deadline of {deadline.seconds:g} s and was aborted"
            ) from None

    def _engine_request(
        self, job: GenerateJob, index: int, prompt: list[int], card: ModelCard
    ) -> tuple[int, EngineCoreRequest]:
        params = job.options.sampling_params(
            len(prompt), card.max_model_len, card.vocab_size, job.prompt_logprobs
        )
        sample = index % job.options.n
        if params.seed is not None and sample:  # vLLM: each of the n samples seeds seed + j
            seed = (params.seed + sample + 2**63) % 2**64 - 2**63  # stays an int64
            params = dataclasses.replace(params, seed=seed)
        request = EngineCoreRequest(
            request_id=f"{job.request_id}-{index}",
            prompt_token_ids=prompt,
            sampling_params=params,
            arrival_time=job.arrival_time,
            priority=job.options.priority,
            mm_inputs=job.images.mm_inputs if job.images is not None else [],
            lora_request=job.lora_request,
            trace_headers=job.trace.headers if job.trace is not None else {},
        )
        return index, request

    def _processor(self, job: GenerateJob, index: int, prompt: list[int]) -> OutputProcessor:
        o = job.options
        return OutputProcessor(
            index,
            self.tokenizer,
            prompt,
            o.stop,
            o.include_stop_str_in_output,
            o.skip_special_tokens,
        )

    async def _run_choice(
        self, job: GenerateJob, index: int, request: EngineCoreRequest, queue: asyncio.Queue[object]
    ) -> None:
        """Stream one engine request into `queue`: deltas, or the exception, then _DONE."""
        processor = self._processor(job, index, request.prompt_token_ids)
        tracker = self.metrics.track_request(request)
        try:
            trace = job.trace
            async with self.engine.generate(request) as stream:
                async for out in stream if trace is None else trace.count(stream):
                    tracker.on_output(out, stream.replica)
                    delta = processor.on_output(out)
                    await queue.put(delta)
                    if delta.finish_reason is not None:
                        tracker.finish(delta.finish_reason)
                        if trace is not None:
                            trace.finish_choice(len(request.prompt_token_ids), out)
                        return  # leaving `async with` cancels the call (stop string)
            raise EngineError("the engine closed the stream before the request finished")
        except Exception as exc:
            tracker.finish("error" if isinstance(exc, EngineError) else None)  # None: refused
            await queue.put(exc)
        finally:
            tracker.finish("abort")  # cancelled (client gone, deadline); no-op once finished
            await queue.put(_DONE)


class _Deadline:
    """When a request that arrived at `arrival_time` (wall clock) must end, in event-loop
    time; never when `seconds` is None."""

    def __init__(self, seconds: float | None, arrival_time: float) -> None:
        self.seconds = seconds
        self.at: float | None = None
        if seconds is not None:
            waited = max(0.0, time.time() - arrival_time)
            self.at = asyncio.get_running_loop().time() + seconds - waited

    def passed(self) -> bool:
        return self.at is not None and asyncio.get_running_loop().time() >= self.at
