"""The Hadamard rotation of an 8-bit KV cache (attention.kv_rotation): H is orthogonal, the
backends store K rotated only in 8-bit pools, and with a channel outlier in K the rotation
makes the attention scores over an int8 cache closer to the float ones."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from benchmarks.attention_cases import PagedCase, build_case
from tests.worker.test_attention_cpu import make_backend
from worker_service.attention import kv_quant, kv_rotation
from worker_service.attention.reference import (
    ReferenceAttentionBackend,
    causal_attention,
    request_slots,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("head_dim", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_hadamard_is_orthogonal_and_symmetric(head_dim: int) -> None:
    h = kv_rotation.hadamard(head_dim, torch.float64, CPU)
    assert h.shape == (head_dim, head_dim)
    torch.testing.assert_close(h @ h.T, torch.eye(head_dim, dtype=torch.float64))
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h.abs(), torch.full_like(h, head_dim**-0.5))  # +-1/sqrt(n)
    assert kv_rotation.hadamard(head_dim, torch.float64, CPU) is h  # cached


def test_rotation_applies_only_to_8bit_pools_of_power_of_two_heads() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        kv_rotation.hadamard(40, torch.float32, CPU)
    assert kv_rotation.applies(torch.empty(0, dtype=torch.int8), 64)
    assert not kv_rotation.applies(torch.empty(0, dtype=torch.int8), 40)  # stored unrotated
    for dtype in (torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.float16):
        assert not kv_rotation.applies(torch.empty(0, dtype=dtype), 64)


def test_model_dtype_pool_stores_k_as_given() -> None:
    case = build_case([(0, 5)], 2, 2, 64, 16, torch.float32)
    ReferenceAttentionBackend().write_kv(
        case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping
    )
    stored = kv_quant.flat_pool(case.k_cache)[case.meta.slot_mapping]
    assert torch.equal(stored, case.key)


# Prefills with and without a prefix, and decodes (the C++ kernel's rows).
REQUESTS = [(0, 24), (20, 9), (40, 1), (17, 1), (31, 1)]


def outlier_case(kv_dtype: torch.dtype) -> PagedCase:
    """REQUESTS over empty 8-bit pools, K with two outlier channels (x40)."""
    case = build_case(REQUESTS, 4, 2, 64, 16, torch.float32)
    for k in case.full_keys:
        k[:, :, [5, 37]] *= 40.0
    case.k_cache = kv_quant.quantize(torch.zeros(case.k_cache.shape), kv_dtype)
    case.v_cache = kv_quant.quantize(torch.zeros(case.v_cache.shape), kv_dtype)
    return case


def write_all(case: PagedCase, write: Callable[..., None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh copies of the case's pools with every request's whole K/V (prefix and new) in."""
    pools = (case.k_cache.clone(), case.v_cache.clone())
    for i, (k, v) in enumerate(zip(case.full_keys, case.full_values, strict=True)):
        slots = request_slots(case.meta.block_table[i], k.shape[0], case.k_cache.shape[1])
        write(k, v, *pools, slots)
    return pools


def dense_float(case: PagedCase) -> torch.Tensor:  # [tokens, heads, dim]
    """Causal attention of each request's new tokens over its float K/V."""
    rows = torch.split(case.query, case.meta.query_lens_cpu)
    outs = [
        causal_attention(q, k, v, case.scale)
        for q, k, v in zip(rows, case.full_keys, case.full_values, strict=True)
    ]
    return torch.cat(outs)


def quantized_scores(q: torch.Tensor, k: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    return q @ kv_quant.dequantize(kv_quant.quantize(k, kv_dtype), torch.float32).T


def score_errors(kv_dtype: torch.dtype) -> tuple[float, float]:
    """Mean |score error| over an 8-bit K with one outlier channel: plain, rotated."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(32, 64, generator=gen)
    k = torch.randn(256, 64, generator=gen)
    k[:, 11] *= 50.0  # one outlier channel, as real K has
    exact = q @ k.T
    rot = kv_rotation.rotate
    plain = (quantized_scores(q, k, kv_dtype) - exact).abs().mean()
    rotated = (quantized_scores(rot(q), rot(k), kv_dtype) - exact).abs().mean()
    return float(plain), float(rotated)


def test_rotation_shrinks_int8_score_error_with_a_channel_outlier() -> None:
    plain, rotated = score_errors(torch.int8)
    assert rotated < 0.5 * plain


def test_rotation_would_hurt_fp8_so_fp8_pools_stay_unrotated() -> None:
    """e4m3 keeps ~1/16 of each value, outlier or not: spreading the outlier over every
    channel only makes each value (and its error) larger."""
    plain, rotated = score_errors(torch.float8_e4m3fn)
    assert rotated > plain
    assert not kv_rotation.applies(torch.empty(0, dtype=torch.float8_e4m3fn), 64)


@pytest.mark.parametrize("mode", ["reference", "kernel", "sdpa-folded"])
def test_backend_output_with_outliers_is_closer_to_float_rotated(mode: str) -> None:
    """int8 through write_kv/forward (rotated) against the same backend's unrotated entry
    points (_write_kv/_forward), both against attention over the float K/V."""
    case = outlier_case(torch.int8)
    backend = ReferenceAttentionBackend() if mode == "reference" else make_backend(mode)
    want = dense_float(case)
    pools = write_all(case, backend.write_kv)
    rotated = backend.forward(case.query, *pools, case.meta, case.scale)
    pools = write_all(case, backend._write_kv)
    plain = backend._forward(case.query, *pools, case.meta, case.scale)
    err_rot, err_plain = (rotated - want).abs().mean(), (plain - want).abs().mean()
    assert float(err_rot) < 0.7 * float(err_plain), (float(err_rot), float(err_plain))
