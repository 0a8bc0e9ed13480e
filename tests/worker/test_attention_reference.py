"""The reference attention backend against dense causal attention on unpaged tensors.

`build_case` (a paged batch with its unpaged ground truth) is reused by the Triton tests
and by benchmarks/gpu_check.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from worker_service.attention.base import AttentionMetadata
from worker_service.attention.reference import ReferenceAttentionBackend

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


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_dense(
    batch: str, num_kv_heads: int, group: int, block_size: int, dtype: torch.dtype
) -> None:
    case = build_case(BATCHES[batch], num_kv_heads * group, num_kv_heads, 64, block_size, dtype)
    backend = ReferenceAttentionBackend()
    backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = backend.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == case.query.shape and out.dtype == dtype
    expected = dense_attention(case)
    torch.testing.assert_close(out.float(), expected, atol=tolerance(dtype), rtol=0)


def test_forward_without_write_kv_sees_nan() -> None:
    """The forward reads new tokens' K/V from the pool, not from anywhere else."""
    case = build_case([(4, 3)], 2, 1, 64, 16)
    out = ReferenceAttentionBackend().forward(
        case.query, case.k_cache, case.v_cache, case.meta, case.scale
    )
    assert out.isnan().all()  # every new token attends to itself, whose slot still holds NaN


def test_write_kv_stores_at_slots_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(4, 16, 2, 64)
    v_cache = torch.zeros(4, 16, 2, 64)
    key, value = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    slots = torch.tensor([37, -1, 5])
    ReferenceAttentionBackend().write_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[2, 5], key[0])
    torch.testing.assert_close(v_cache[0, 5], value[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2  # nothing else written


def test_non_contiguous_pool_is_rejected() -> None:
    pool = torch.zeros(2, 2, 16, 64).transpose(1, 2)  # [2, 16, 2, 64] strided
    with pytest.raises(ValueError, match="contiguous"):
        ReferenceAttentionBackend().write_kv(
            torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), pool, pool, torch.tensor([0])
        )
