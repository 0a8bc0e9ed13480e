"""A deterministic fake model runner that checks the scheduler <-> worker contract.

It implements services.worker_api.WorkerProtocol. The "model" samples
next = (last token + 1) % vocab_size. Its KV pool is a list of slots; computing
position p of a request writes a fingerprint of the request's tokens [0..p]
into slot block_ids[p // B] * B + p % B. Before computing, it asserts that every
earlier position's slot holds the right fingerprint, so a wrong block table, a
bad prefix-cache hit or a reused block that was still needed fails loudly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.step_types import (
    KVCacheSpec,
    ModelInfo,
    ModelRunnerOutput,
    SampledLogprobs,
    SchedulerOutput,
)
from services.types import TokenLogprobs

BYTES_PER_BLOCK = 1024


class ContractError(AssertionError):
    """The scheduler broke the worker contract."""


@dataclass
class _ReqState:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    fingerprints: list[int] = field(default_factory=list)  # fingerprint of tokens[0..p]

    def fingerprint(self, p: int) -> int:
        while len(self.fingerprints) <= p:
            i = len(self.fingerprints)
            prev = self.fingerprints[-1] if self.fingerprints else 0
            self.fingerprints.append(hash((prev, self.tokens[i])))
        return self.fingerprints[p]


class FakeWorker:
    """WorkerProtocol with deterministic tokens and strict contract checks."""

    def __init__(
        self,
        *,
        vocab_size: int = 1000,
        max_model_len: int = 256,
        eos_token_ids: tuple[int, ...] = (),
        block_size: int = 4,
        available_blocks: int = 64,
        step_delay_s: float = 0.0,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.available_blocks = available_blocks
        self.step_delay_s = step_delay_s
        self.num_blocks = 0
        self.slots: list[int | None] = []
        self.requests: dict[str, _ReqState] = {}
        self.steps: list[SchedulerOutput] = []
        self.fail_requests: dict[str, str] = {}  # request id -> error, reported per request
        self.errored: set[str] = set()  # dropped after a request error, as the real runner does
        self.raise_on_step: Callable[[SchedulerOutput], None] | None = None
        self.step_started = threading.Event()

    # ---- handshake ------------------------------------------------------------

    def get_model_info(self) -> ModelInfo:
        return ModelInfo(
            model_name="fake",
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            architecture="Fake",
            dtype="float32",
            device="cpu",
        )

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, 1, 1, "float32", self.block_size, BYTES_PER_BLOCK)

    def determine_available_memory(self) -> int:
        return self.available_blocks * BYTES_PER_BLOCK

    def initialize_cache(self, num_blocks: int) -> int:
        self.num_blocks = num_blocks
        self.slots = [None] * (num_blocks * self.block_size)
        return num_blocks * BYTES_PER_BLOCK

    def shutdown(self) -> None:
        self.requests.clear()

    # ---- the step -------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.step_started.set()
        self.steps.append(scheduler_output)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.raise_on_step is not None:
            self.raise_on_step(scheduler_output)
        self._apply_request_changes(scheduler_output)
        output = ModelRunnerOutput(step_id=scheduler_output.step_id)
        sampled: list[list[int]] = []
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            if request_id in self.fail_requests or request_id in self.errored:
                error = self.fail_requests.get(request_id, "dropped after an error")
                output.request_errors[request_id] = error
                self.requests.pop(request_id, None)
                self.errored.add(request_id)  # a step sent ahead may still name it
                continue
            output.req_ids.append(request_id)
            sampled.append(self._compute(request_id, num_tokens))
            if sampled[-1]:
                lp = TokenLogprobs(sampled[-1][0], -0.5, 1)
                output.sampled_logprobs.append(SampledLogprobs(request_id, [lp]))
        output.set_sampled(output.req_ids, sampled)
        return output

    def _apply_request_changes(self, so: SchedulerOutput) -> None:
        for request_id in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.requests.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.requests[new.request_id] = _ReqState(
                tokens, list(new.block_ids), new.num_computed_tokens
            )
        for request_id, num_computed, new_block_ids in so.scheduled_cached_reqs.rows():
            if request_id in self.errored:
                continue
            state = self.requests.get(request_id)
            _check(state is not None, f"delta for unknown request {request_id}")
            assert state is not None
            _check(
                num_computed == state.num_computed,
                f"{request_id}: num_computed {num_computed} != {state.num_computed}",
            )
            state.block_ids.extend(new_block_ids)
        _check(
            so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()),
            "total_num_scheduled_tokens",
        )

    def _compute(self, request_id: str, num_tokens: int) -> list[int]:
        state = self.requests.get(request_id)
        _check(state is not None, f"scheduled unknown request {request_id}")
        assert state is not None
        start, end = state.num_computed, state.num_computed + num_tokens
        _check(num_tokens > 0 and end <= len(state.tokens), f"{request_id}: range {start}:{end}")
        _check(len(state.block_ids) * self.block_size >= end, f"{request_id}: block table short")
        for p in range(start):  # the KV this step attends to must be this request's prefix
            _check(
                self.slots[self._slot(state, p)] == state.fingerprint(p), f"{request_id}: KV@{p}"
            )
        for p in range(start, end):
            self.slots[self._slot(state, p)] = state.fingerprint(p)
        state.num_computed = end
        if end < len(state.tokens):
            return []
        token = (state.tokens[-1] + 1) % self.vocab_size
        state.tokens.append(token)
        return [token]

    def _slot(self, state: _ReqState, position: int) -> int:
        block_id = state.block_ids[position // self.block_size]
        _check(0 <= block_id < self.num_blocks, f"block id {block_id} out of range")
        return block_id * self.block_size + position % self.block_size


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(message)
