"""Paged attention cases with their unpaged ground truth, shared by the attention tests
(tests/worker) and benchmarks/gpu_check.py, so the same cases run on CPU and on the GPU.

`build_case` builds a packed step over a shuffled paged pool; `dense_attention` is the
ground truth from torch SDPA on the unpaged tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_service.attention.base import AttentionMetadata

POISON_BLOCK = 0  # never given to a request; NaN-filled and used to pad block tables


@dataclass
class PagedCase:
    """A packed step over a paged pool, plus the same data unpaged."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim] new tokens' K
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], prefixes written
    v_cache: torch.Tensor
    meta: AttentionMetadata
    full_keys: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim]
    full_values: list[torch.Tensor]
    scale: float


def build_case(
    requests: list[tuple[int, int]],  # (cached prefix length, new tokens) per request
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedCase:
    """Random request data in shuffled blocks; only the cached prefixes are in the pool yet,
    every unused slot holds NaN so that a read outside a request's KV shows."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + new for ctx, new in requests]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is poison
    table = torch.full((len(requests), max(blocks_per_req)), POISON_BLOCK, dtype=torch.int32)
    pool_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(pool_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(pool_shape, float("nan"), dtype=dtype)
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    queries, keys, values, slot_maps, full_keys, full_values = [], [], [], [], [], []
    for i, ((ctx, new), n_blocks) in enumerate(zip(requests, blocks_per_req, strict=True)):
        table[i, :n_blocks] = torch.tensor([ids.pop() for _ in range(n_blocks)], dtype=torch.int32)
        slots = _slots(table[i], ctx + new, block_size)
        k = torch.randn(ctx + new, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx + new, num_kv_heads, head_dim, generator=gen).to(dtype)
        flat_k[slots[:ctx]], flat_v[slots[:ctx]] = k[:ctx], v[:ctx]
        queries.append(torch.randn(new, num_heads, head_dim, generator=gen).to(dtype))
        keys.append(k[ctx:])
        values.append(v[ctx:])
        slot_maps.append(slots[ctx:])
        full_keys.append(k.to(device))
        full_values.append(v.to(device))
    query_lens = [new for _, new in requests]
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.cat(slot_maps).to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return PagedCase(
        query=torch.cat(queries).to(device),
        key=torch.cat(keys).to(device),
        value=torch.cat(values).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        meta=meta,
        full_keys=full_keys,
        full_values=full_values,
        scale=head_dim**-0.5,
    )


def _slots(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len)
    return block_row[pos // block_size].long() * block_size + pos % block_size


def dense_attention(case: PagedCase) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] fp32
    """Ground truth from the unpaged tensors with torch SDPA and an explicit causal mask."""
    outs = []
    for i, q_len in enumerate(case.meta.query_lens_cpu):
        start = int(case.meta.query_start_loc[i])
        q = case.query[start : start + q_len].float().transpose(0, 1)  # [heads, q_len, dim]
        k = case.full_keys[i].float().transpose(0, 1)  # [kv_heads, seq_len, dim]
        v = case.full_values[i].float().transpose(0, 1)
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        seq_len = k.shape[1]
        visible = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
        mask = visible[seq_len - q_len :]  # [q_len, seq_len]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance against the float32 ground truth for outputs stored in `dtype`."""
    return 1e-5 if dtype == torch.float32 else 2e-2


# Named batches: (cached prefix, new tokens) per request.
BATCHES = {
    "prefill": [(0, 7), (0, 21)],
    "prefill_with_prefix": [(16, 5), (37, 12)],
    "decode": [(40, 1), (3, 1), (16, 1)],
    "mixed": [(0, 9), (33, 1), (20, 6), (5, 1)],
}
TRITON_BATCHES = {
    **BATCHES,
    "long": [(45, 70), (100, 1), (0, 33)],  # several query blocks and key tiles per request
    "empty_requests": [(10, 3), (0, 0), (20, 1), (5, 0)],  # padding rows (no new tokens)
}
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# The Triton kernel cases: (batch, kv heads, query heads per kv head, block size, dtype,
# head_dim), run under the interpreter by tests/worker and on CUDA by gpu_check.
ATTENTION_CASES = [
    *[(b, 2, g, bs, F32, 64) for b in sorted(TRITON_BATCHES) for g in (1, 3) for bs in (16, 32)],
    *[(b, 2, g, 16, BF16, 64) for b in sorted(BATCHES) for g in (1, 3)],
    *[("mixed", 2, g, 32, BF16, 64) for g in (1, 3)],
    *[("mixed", 2, 3, bs, F16, 64) for bs in (16, 32)],
    *[(b, 1, 3, 16, dt, 128) for b in ("mixed", "prefill_with_prefix") for dt in (F32, BF16)],
]
