"""Per-request state kept between steps, and the packed varlen batch built from it.

Token ids and block tables live in preallocated numpy tables, one row per live
request, so building a step's batch is a handful of vectorized gathers: no
per-token Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.step_types import NewRequestData
from services.types import LoRARequest, PoolingParams, SamplingParams
from worker_service.attention.base import AttentionMetadata


@dataclass
class RequestState:
    """What the worker remembers about one request between steps."""

    req_id: str
    row: int  # row in InputBatch tables
    prompt_len: int
    num_tokens: int  # prompt + outputs held in the token table
    num_computed: int  # tokens whose KV is in the pool before the current step
    num_blocks: int
    params: SamplingParams
    resumed: bool = False  # re-sent after preemption: prompt logprobs were already reported
    matcher: Any = None  # llguidance.LLMatcher of a structured-output request (see structured.py)
    pooling: PoolingParams | None = None  # an embedding request: pooled, never sampled
    pooled: Any = None  # its running pool over the chunks so far (worker_service.pooler)
    num_drafts: int = 0  # draft tokens written after num_tokens for this step (spec decoding)
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    rope_len: int = 0  # the length its tokens rotate at, at least (length-dependent rope)

    @property
    def lora_id(self) -> int:
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def num_outputs(self) -> int:
        return self.num_tokens - self.prompt_len


@dataclass
class StepBatch:
    """One step's packed batch, requests ordered decode-first."""

    req_ids: list[str]
    states: list[RequestState]
    num_scheduled: np.ndarray  # [num_reqs] int64
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_reqs: list[int] = field(default_factory=list)  # indices into req_ids that sample
    logits_indices: torch.Tensor | None = None  # [num_sample] rows of the hidden states
    # With drafts: logit rows per sampling request (1 + its drafts), logits_indices then
    # holding sum(num_logits) rows; None when the step has no drafts (one row each).
    num_logits: list[int] | None = None


class InputBatch:
    """Request rows: token table [rows, max_model_len], block table [rows, max_blocks]."""

    def __init__(
        self,
        max_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        rotate_whole_sequence: bool = False,
    ) -> None:
        self.block_size, self.vocab_size, self.max_model_len = block_size, vocab_size, max_model_len
        # True (Phi-3 longrope): a (re)admitted request's tokens all rotate at its length then,
        # outputs included; else at its prompt length (outputs: each at its own position + 1)
        self.rotate_whole_sequence = rotate_whole_sequence
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_reqs, self.max_blocks), dtype=np.int32)
        self.free_rows = list(range(max_reqs - 1, -1, -1))
        self.requests: dict[str, RequestState] = {}
        self.num_pooling = 0  # live embedding requests; 0: the runner skips pooling entirely

    def add(self, new: NewRequestData) -> RequestState:
        """Take a new (or resumed) request; ValueError if it cannot run on this model."""
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        self._validate(new, tokens)
        self.remove(new.request_id)
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.token_ids[row, : len(tokens)] = tokens
        self.block_table[row] = 0  # no stale block ids from the row's previous owner
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        state = RequestState(
            new.request_id,
            row,
            len(new.prompt_token_ids),
            len(tokens),
            new.num_computed_tokens,
            len(new.block_ids),
            new.sampling_params,
            new.resumed_from_preemption and bool(new.output_token_ids),  # prefill was complete
            lora=new.lora_request,
            rope_len=len(tokens if self.rotate_whole_sequence else new.prompt_token_ids),
        )
        if new.pooling_params is not None:
            state.pooling = new.pooling_params
            self.num_pooling += 1
        self.requests[new.request_id] = state
        return state

    def update(self, req_id: str, num_computed: int, new_block_ids: list[int]) -> None:
        """Apply a step's delta: new blocks appended, the computed count replaced."""
        state = self.requests.get(req_id)
        if state is None:
            raise ValueError(f"cached request {req_id!r} is unknown to this worker")
        end = state.num_blocks + len(new_block_ids)
        if end > self.max_blocks:
            raise ValueError(f"request {req_id!r} has more blocks than max_model_len allows")
        self.block_table[state.row, state.num_blocks : end] = new_block_ids
        state.num_blocks, state.num_computed = end, num_computed

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.free_rows.append(state.row)
            if state.pooling is not None:
                self.num_pooling -= 1

    def set_drafts(self, state: RequestState, drafts: list[int]) -> None:
        """Write a step's draft tokens after the request's tokens (not counted in them)."""
        end = state.num_tokens + len(drafts)
        if end > self.max_model_len:
            raise ValueError(f"request {state.req_id!r}: drafts run past max_model_len")
        if drafts and (min(drafts) < 0 or max(drafts) >= self.vocab_size):
            raise ValueError(f"draft token ids must be in [0, {self.vocab_size})")
        self.token_ids[state.row, state.num_tokens : end] = drafts
        state.num_drafts = len(drafts)

    def extend_tokens(self, state: RequestState, tokens: list[int]) -> None:
        """Append several tokens (accepted drafts + one) to the request's token list."""
        end = min(state.num_tokens + len(tokens), self.max_model_len)
        self.token_ids[state.row, state.num_tokens : end] = tokens[: end - state.num_tokens]
        state.num_tokens += len(tokens)

    def append_tokens(self, states: list[RequestState], tokens: list[int]) -> None:
        """Append each sampled token to its request's token list."""
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        cols = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        ok = cols < self.max_model_len
        self.token_ids[rows[ok], cols[ok]] = np.asarray(tokens, dtype=np.int64)[ok]
        for s in states:
            s.num_tokens += 1

    def check_schedulable(self, state: RequestState, num_scheduled: int) -> None:
        """ValueError when the scheduler asks for tokens the request does not have or cannot store."""
        end = state.num_computed + num_scheduled
        if num_scheduled < 1 or end > state.num_tokens + state.num_drafts:
            raise ValueError(
                f"request {state.req_id!r}: cannot compute tokens [{state.num_computed}, {end}) "
                f"of {state.num_tokens}"
            )
        if end > state.num_blocks * self.block_size:
            raise ValueError(
                f"request {state.req_id!r}: {state.num_blocks} blocks hold fewer than {end} tokens"
            )

    def prepare(
        self,
        order: list[RequestState],
        num_scheduled: list[int],
        device: torch.device,
        has_drafts: bool = False,
    ) -> StepBatch:
        """Pack the scheduled tokens of `order` (already decode-first) into one batch;
        `has_drafts`: some requests verify drafts (RequestState.num_drafts) this step."""
        rows = np.fromiter((s.row for s in order), dtype=np.int64, count=len(order))
        computed = np.fromiter((s.num_computed for s in order), dtype=np.int64, count=len(order))
        sched = np.asarray(num_scheduled, dtype=np.int64)
        cu = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(sched, out=cu[1:])
        total = int(cu[-1])
        token_rows = np.repeat(rows, sched)  # [num_tokens]
        positions = np.repeat(computed - cu[:-1], sched) + np.arange(total)
        input_ids = self.token_ids[token_rows, positions]
        blocks = self.block_table[token_rows, positions // self.block_size].astype(np.int64)
        slots = blocks * self.block_size + positions % self.block_size
        seq_lens = computed + sched
        max_seq = int(seq_lens.max())
        table = self.block_table[rows, : -(-max_seq // self.block_size)]
        meta = AttentionMetadata(
            query_start_loc=_tensor(cu.astype(np.int32), device),
            seq_lens=_tensor(seq_lens.astype(np.int32), device),
            block_table=_tensor(table, device),
            slot_mapping=_tensor(slots, device),
            max_query_len=int(sched.max()),
            max_seq_len=max_seq,
            query_lens_cpu=sched.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            prompt_lens_cpu=[s.rope_len for s in order],
        )
        if has_drafts:
            return self._with_drafts(order, sched, input_ids, positions, meta, cu, device)
        sample = [i for i, s in enumerate(order) if seq_lens[i] == s.num_tokens]
        return StepBatch(
            [s.req_id for s in order],
            order,
            sched,
            _tensor(input_ids, device),
            _tensor(positions, device),
            meta,
            sample,
            _tensor(cu[1:][sample] - 1, device),
        )

    def _with_drafts(
        self,
        order: list[RequestState],
        sched: np.ndarray,
        input_ids: np.ndarray,
        positions: np.ndarray,
        meta: AttentionMetadata,
        cu: np.ndarray,
        device: torch.device,
    ) -> StepBatch:
        """The batch of a step with drafts: a request that reaches the end of its tokens plus
        drafts gets a logit row per draft and one after the last."""
        ends = [int(s.num_computed + sched[i]) for i, s in enumerate(order)]
        sample = [i for i, s in enumerate(order) if ends[i] == s.num_tokens + s.num_drafts]
        meta.verify_reqs = [i for i, s in enumerate(order) if s.num_drafts]
        num_logits = [1 + order[i].num_drafts for i in sample]
        rows = [
            r
            for i, n in zip(sample, num_logits, strict=True)
            for r in range(cu[i + 1] - n, cu[i + 1])
        ]
        return StepBatch(
            [s.req_id for s in order],
            order,
            sched,
            _tensor(input_ids, device),
            _tensor(positions, device),
            meta,
            sample,
            _tensor(np.asarray(rows, dtype=np.int64), device),
            num_logits,
        )

    def _validate(self, new: NewRequestData, tokens: list[int]) -> None:
        if not new.prompt_token_ids:
            raise ValueError("empty prompt")
        if len(tokens) > self.max_model_len:
            raise ValueError(f"{len(tokens)} tokens exceed max_model_len {self.max_model_len}")
        if len(new.block_ids) > self.max_blocks:
            raise ValueError(f"{len(new.block_ids)} blocks exceed what max_model_len allows")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        bad = [t for t in new.sampling_params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias token id {bad[0]} is outside the vocabulary ({self.vocab_size})"
            )

    def _grow(self) -> None:
        n = self.token_ids.shape[0]
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.free_rows.extend(range(2 * n - 1, n - 1, -1))


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
