"""Reference attention backend: plain torch, one request at a time, slow and obviously right.

It is the yardstick the fast backends are tested against. K/V are gathered from the
paged pool through the block table, the causal mask is offset by the cached prefix,
GQA repeats each kv head for its group of query heads, and softmax runs in float32.
"""

from __future__ import annotations

import torch

from worker_service.attention import kv_quant
from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.attention.kv_quant import flat_pool


def request_slots(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions 0..seq_len-1 of one request, from its block-table row."""
    positions = torch.arange(seq_len, device=block_row.device)  # [seq_len]
    block_ids = block_row[positions // block_size].long()  # [seq_len]
    return block_ids * block_size + positions % block_size


def causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [q_len, num_heads, head_dim], float32
    """Dense attention of the last q_len positions of a sequence over all its seq_len keys.

    Query row j sits at absolute position seq_len - q_len + j and sees keys 0..that position
    (only the last `window` of them, itself included, with a sliding window > 0, as HF's
    sliding-window mask: q_pos - k_pos < window). With `softcap` > 0 the scaled scores are
    soft-capped as HF's eager attention does: softcap * tanh(score / softcap).
    Query head h reads kv head h // (num_heads // num_kv_heads).
    """
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    key = key.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
    value = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale  # [heads, q_len, seq_len]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
    k_pos = torch.arange(seq_len, device=query.device)  # [seq_len]
    hidden = k_pos[None, :] > q_pos[:, None]  # [q_len, seq_len]
    if window > 0:
        hidden |= k_pos[None, :] <= q_pos[:, None] - window
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, value)


class ReferenceAttentionBackend(AttentionBackend):
    """Plain-torch paged attention; loops over requests on the host."""

    name = "reference"

    def _write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Store each token's K/V at its slot; tokens with a negative slot (padding) are skipped."""
        keep = slot_mapping >= 0  # [num_tokens]
        slots = slot_mapping[keep].long()
        kv_quant.write(key[keep], k_cache, slots)  # quantized first in a quantized pool
        kv_quant.write(value[keep], v_cache, slots)

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
        out = torch.empty_like(query)
        block_size = k_cache.shape[1]
        flat_k, flat_v = flat_pool(k_cache), flat_pool(v_cache)
        start = 0
        for i, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            slots = request_slots(meta.block_table[i], seq_len, block_size)  # [seq_len]
            rows = slice(start, start + q_len)
            k = kv_quant.gather(flat_k, slots, query.dtype)
            v = kv_quant.gather(flat_v, slots, query.dtype)
            out[rows] = causal_attention(query[rows], k, v, scale, window, softcap)
            start += q_len
        return out
