"""The scheduler's view of one request: its tokens, progress, blocks and status."""

from __future__ import annotations

import enum
import time

from services.types import (
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    MultiModalInput,
    PoolingParams,
    RequestTimestamps,
    SamplingParams,
    TokenLogprobs,
)


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; the FINISHED_* values are final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason:
        """The wire-level reason; UNSPECIFIED while not finished."""
        return _FINISH_REASONS.get(self, FinishReason.UNSPECIFIED)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One generation, owned by the scheduler from admission to finish.

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `num_computed_tokens <= num_tokens` counts tokens whose KV is in the pool (committed);
    the workers are `num_inflight_tokens` ahead and will have sampled
    `num_output_placeholders` more tokens once the steps in flight are committed;
    `block_ids` is the block table (block i holds tokens [i*B, (i+1)*B));
    `block_hashes[i]` is the prefix hash of full block i (computed lazily).
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_salt",
        "error",
        "lora_request",
        "max_tokens",
        "mm_inputs",
        "num_admitted_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_hashed_blocks",
        "num_inflight_tokens",
        "num_output_placeholders",
        "num_prompt_tokens",
        "num_tokens",
        "pending_prompt_logprobs",
        "pooling_params",
        "priority",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_reason",
        "timestamps",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_model_len: int,
        *,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str = "",
        mm_inputs: list[MultiModalInput] | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens  # == len(all_token_ids), kept for speed
        self.sampling_params = sampling_params
        room = max_model_len - self.num_prompt_tokens
        requested = sampling_params.max_tokens
        self.max_tokens = room if requested is None else min(requested, room)
        # An embedding request: prefill only; its one "output" is the pooled vector.
        self.pooling_params = pooling_params
        if pooling_params is not None:
            self.max_tokens = 1
        self.arrival_time = arrival_time or time.time()
        self.priority = priority
        self.cache_salt = cache_salt
        self.mm_inputs: list[MultiModalInput] = list(mm_inputs or ())
        self.lora_request = lora_request  # None: the base model
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_admitted_tokens = 0  # its length when last admitted (sent to the workers)
        # Async scheduling: tokens scheduled in steps whose output has not been committed,
        # and how many of those steps will sample a token (not yet known here).
        self.num_inflight_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1: not yet
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.stop_reason: int | None = None
        self.error = ""
        self.timestamps = RequestTimestamps(queued=time.time())
        self.pending_prompt_logprobs: list[TokenLogprobs] = []
        self.spec_token_ids: list[int] = []  # drafts to verify next step (speculative decoding)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            max_model_len,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            mm_inputs=req.mm_inputs,
            pooling_params=req.pooling_params,
            lora_request=req.lora_request,
        )

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def sort_key(self) -> tuple[int, float]:
        """Smaller runs first under the priority policy: (priority, arrival)."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
