"""The attention backend interface: paged KV writes and varlen paged attention.

KV pools, one K and one V tensor per layer, are shaped
`[num_blocks, block_size, num_kv_heads, head_dim]`. A token's slot is
`block_id * block_size + offset_in_block`. A step's batch is packed: the new
tokens of all requests are concatenated along dim 0, request by request.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from worker_service.attention import kv_rotation


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the model runner and shared by all layers."""

    # [num_reqs + 1] int32: query_start_loc[i] is where request i's new tokens start.
    query_start_loc: torch.Tensor
    # [num_reqs] int32: tokens of request i with KV after this step (cached prefix + new).
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32: request i's block ids (padding unused).
    block_table: torch.Tensor
    # [num_tokens] int64: the slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # Largest number of new tokens of one request in this step (1 for pure decode).
    max_query_len: int
    # Largest seq_lens entry.
    max_seq_len: int
    # Host copies of query lengths and seq lens, for backends that loop or bucket on the CPU.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Requests verifying draft tokens (speculative decoding): their new tokens follow a
    # decoded sequence, so a backend may attend each of them as a decode row of its own.
    verify_reqs: list[int] = field(default_factory=list)
    # Host copy of each request's rope length (rope types that depend on it: dynamic,
    # longrope): its prompt length (Phi-3 longrope: its whole length when admitted); empty
    # when the step's builder does not know them.
    prompt_lens_cpu: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(abc.ABC):
    """Writes new K/V into the paged pool and attends causally over it."""

    name: str = "base"

    def match_hf_kernels(self) -> None:
        """Call the kernels exactly as HF does, where a faster call would round differently
        (bit-exact bf16 runs); backends with nothing to change keep this no-op."""
        return None

    def make_batch_invariant(self) -> None:
        """--deterministic: from now on, each token's attention output depends only on its own
        query and the K/V of its own causal context (bit for bit), not on the step's other
        requests, its chunking or prefix-cache hits. Backends without such a mode refuse."""
        raise ValueError(f"--deterministic is not supported by the {self.name} attention backend")

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Store each token's K and V at its slot (in place). An int8 pool stores K (and V
        with kv_rotation.ROTATE_V) rotated by the Hadamard matrix (kv_rotation)."""
        if kv_rotation.applies(k_cache, key.shape[-1]):
            key = kv_rotation.rotate(key)
            if kv_rotation.ROTATE_V:
                value = kv_rotation.rotate(value)
        self._write_kv(key, value, k_cache, v_cache, slot_mapping)

    @abc.abstractmethod
    def _write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """write_kv's store, of K/V as given (already rotated for an int8 pool)."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention of each new token over its request's KV (cached prefix + new tokens up to
        and including itself), reading K/V only from the pool; GQA when num_heads > num_kv_heads.
        With a sliding `window` > 0, each token sees only the last `window` tokens up to and
        including itself (HF: q_pos - k_pos < window); blocks before that may have been freed.
        With `softcap` > 0, scaled scores are soft-capped: softcap * tanh(score / softcap).
        Call after write_kv for the same step."""
        if not kv_rotation.applies(k_cache, query.shape[-1]):
            return self._forward(query, k_cache, v_cache, meta, scale, window, softcap)
        # An int8 pool holds K rotated by H: q H against it gives the same scores as q k^T.
        out = self._forward(
            kv_rotation.rotate(query), k_cache, v_cache, meta, scale, window, softcap
        )
        return kv_rotation.rotate(out) if kv_rotation.ROTATE_V else out  # out H^T = out H

    @abc.abstractmethod
    def _forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """forward's attention, of the query as given (already rotated for an int8 pool)."""
