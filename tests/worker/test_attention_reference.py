"""The reference attention backend against dense causal attention on unpaged tensors.

The cases (`build_case`, `BATCHES`, `dense_attention`) live in benchmarks/attention_cases.py,
shared with the Triton tests and benchmarks/gpu_check.py.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention_cases import BATCHES, build_case, dense_attention, tolerance
from worker_service.attention.reference import ReferenceAttentionBackend


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
