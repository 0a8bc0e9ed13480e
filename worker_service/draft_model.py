"""Speculative decoding with a draft model (`"method": "draft_model"`): a small model with
the target's tokenizer proposes K tokens greedily.

The draft keeps its own KV pool with the target's block ids (a second set of K/V tensors
with the same number of blocks, counted in the worker's KV memory handshake), so the
scheduler's block tables and slot mappings serve both. Each step the draft runs over the
step's tokens with the target's attention metadata, which keeps its KV in step with the
target's; after sampling it decodes K tokens from each speculating request's last token.
Those K decode steps write draft KV at K positions past the request's tokens: the
scheduler reserves K lookahead slots for them. Slots of tokens later rejected are
overwritten when the real tokens get there, in both pools.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from services.config import SpeculativeConfig
from services.default_model import resolve_model
from services.step_types import DraftTokens, KVCacheSpec
from worker_service import kv_cache
from worker_service.attention.base import AttentionBackend
from worker_service.input_batch import InputBatch, RequestState, StepBatch
from worker_service.loader import load_model
from worker_service.models.context import forward_context
from worker_service.sampler import argmax_rows
from worker_service.spec_decode import can_speculate


class DraftModelProposer:
    """The draft model, its KV pool and its proposals."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target_vocab: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.model = load_model(Path(resolve_model(config.model)), dtype, device, backend)
        if self.model.config.vocab_size != target_vocab:
            raise ValueError(
                f"draft model vocabulary {self.model.config.vocab_size} != target's "
                f"{target_vocab}: the draft must share the target's tokenizer"
            )
        self.k, self.dtype, self.device = config.num_speculative_tokens, dtype, device
        self.block_size, self.max_model_len = block_size, max_model_len
        self.spec = kv_cache.make_spec(self.model.config, block_size, dtype)

    def allocate(self, num_blocks: int) -> int:
        return kv_cache.allocate(self.model, self.spec, num_blocks, self.dtype, self.device)

    def release(self) -> None:
        kv_cache.release(self.model)

    def combined(self, target: KVCacheSpec) -> KVCacheSpec:
        """The target's spec with a block's bytes counting both pools (the handshake)."""
        return dataclasses.replace(
            target, bytes_per_block=target.bytes_per_block + self.spec.bytes_per_block
        )

    def observe(self, step: StepBatch) -> None:
        """Run the draft over the step's tokens: its KV follows the target's."""
        with forward_context(step.meta):
            self.model(step.input_ids, step.positions)

    def propose(self, states: list[RequestState], batch: InputBatch) -> list[DraftTokens]:
        """Up to K greedy draft tokens per speculating request (decoded from its last token)."""
        k_of = {s.req_id: self._room(s) for s in states if can_speculate(s.params, s.num_outputs)}
        live = [s for s in states if k_of.get(s.req_id, 0) > 0]
        drafts: dict[str, list[int]] = {s.req_id: [] for s in live}
        for i in range(max((k_of[s.req_id] for s in live), default=0)):
            live = [s for s in live if k_of[s.req_id] > i]
            # decode position num_tokens - 1 + i: the last token, then the drafts so far
            rows = [
                dataclasses.replace(
                    s, num_computed=s.num_tokens - 1 + i, num_tokens=s.num_tokens + i, num_drafts=0
                )
                for s in live
            ]
            step = batch.prepare(rows, [1] * len(rows), self.device)
            with forward_context(step.meta):
                hidden = self.model(step.input_ids, step.positions)  # [n, hidden]
            tokens = argmax_rows(self.model.compute_logits(hidden)).tolist()
            for state, token in zip(live, tokens, strict=True):
                batch.token_ids[state.row, state.num_tokens + i] = token
                drafts[state.req_id].append(token)
        return [DraftTokens(req_id, ids) for req_id, ids in drafts.items() if ids]

    def _room(self, state: RequestState) -> int:
        """Drafts the request can take: K, within max_model_len and its blocks (the last
        draft decode writes KV at position num_tokens + K - 2)."""
        in_blocks = state.num_blocks * self.block_size - (state.num_tokens - 1)
        return min(self.k, self.max_model_len - state.num_tokens - 1, in_blocks)
