"""The quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3): its layout and round trip, and
every CPU-side reader (the reference backend, the CPU backend's C++ decode kernel at each CPU
level this machine runs, its SDPA decode and prefill) against dense float32 attention over
the dequantized K/V, at block boundaries, GQA groups 1-8 and head sizes 64/128."""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention_cases import PagedCase, build_case, dense_attention
from tests.worker.test_attention_cpu import FAR, MANY_DECODES, make_backend
from worker_service import native
from worker_service.attention import cpu_kernel, kv_quant, kv_rotation
from worker_service.attention.reference import ReferenceAttentionBackend

KV_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# Decodes of scattered lengths (in and across blocks), prefills with and without a prefix.
REQUESTS = [*MANY_DECODES, (16, 5), (37, 12), (31, 1), (32, 1)]


def quantized_case(
    requests: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> PagedCase:
    """build_case with quantized pools (unused slots FAR, quantized too; K Hadamard-rotated
    as write_kv stores it, where the head size allows) and, as ground truth, each request's
    K/V as the pool holds them: dequantized to float32, K rotated back (unrotated scores)."""
    case = build_case(requests, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype)
    rotated = kv_rotation.applies(torch.empty(0, dtype=kv_dtype), head_dim)
    spin = kv_rotation.rotate if rotated else (lambda t: t)
    vspin = spin if kv_rotation.ROTATE_V else (lambda t: t)
    case.k_cache = kv_quant.quantize(spin(case.k_cache.nan_to_num(FAR)), kv_dtype)
    case.v_cache = kv_quant.quantize(vspin(case.v_cache.nan_to_num(FAR)), kv_dtype)
    case.full_keys[:] = [
        spin(kv_quant.dequantize(kv_quant.quantize(spin(t), kv_dtype), torch.float32))
        for t in case.full_keys
    ]
    case.full_values[:] = [
        vspin(kv_quant.dequantize(kv_quant.quantize(vspin(t), kv_dtype), torch.float32))
        for t in case.full_values
    ]
    return case


def run_backend(backend: object, case: PagedCase) -> torch.Tensor:
    backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)  # type: ignore[attr-defined]
    out: torch.Tensor = backend.forward(  # type: ignore[attr-defined]
        case.query, case.k_cache, case.v_cache, case.meta, case.scale
    )
    return out


def tolerance(dtype: torch.dtype) -> float:
    """Against float32 over the same dequantized K/V: only the output's (and, for bf16, the
    query's and SDPA's dequantized K/V) rounding differs."""
    return 2e-5 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_round_trip_error_and_layout(kv: str) -> None:
    kv_dtype = KV_DTYPES[kv]
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]  # [tokens, heads, dim]
    x[7] = 0.0
    packed = kv_quant.quantize(x, kv_dtype)
    assert packed.shape == (50, 3, 66) and packed.dtype == kv_dtype
    back = kv_quant.dequantize(packed, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    step = (amax / kv_quant._QMAX[kv_dtype]).clamp(min=2**-14)  # the scale, before float16
    assert torch.equal(kv_quant.scales(packed), step.squeeze(-1).half().float())
    err = (back - x).abs()
    if kv == "int8":  # half a step (the float16 scale rounds a little too)
        assert bool((err <= step * 0.5 * (1 + 2e-3)).all())
    else:  # e4m3: 3 mantissa bits, so within 1/16 of each value, or of the step near zero
        assert bool((err <= x.abs() / 16 + step * 2**-6).all())
    assert bool((back[7] == 0).all())


def test_slot_width_refuses_odd_head_sizes() -> None:
    assert kv_quant.slot_width(64, torch.bfloat16) == 64
    assert kv_quant.slot_width(64, torch.int8) == 66
    with pytest.raises(ValueError, match="even head size"):
        kv_quant.slot_width(65, torch.int8)


@pytest.mark.parametrize("mode", ["reference", "kernel", "sdpa-folded", "hf-call"])
@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_backends_match_dense_over_dequantized_kv(
    mode: str, kv: str, dtype: torch.dtype, block_size: int
) -> None:
    case = quantized_case(REQUESTS, 2, 3, 64, block_size, dtype, KV_DTYPES[kv])
    backend = ReferenceAttentionBackend() if mode == "reference" else make_backend(mode)
    out = run_backend(backend, case)
    assert out.shape == case.query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), dense_attention(case), atol=tolerance(dtype), rtol=0)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])  # register-held sums to 6, then a loop
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_kernel_groups_and_head_sizes(
    group: int, head_dim: int, kv: str, dtype: torch.dtype
) -> None:
    case = quantized_case(MANY_DECODES, 1, group, head_dim, 16, dtype, KV_DTYPES[kv])
    out = run_backend(make_backend("kernel"), case)
    torch.testing.assert_close(out.float(), dense_attention(case), atol=tolerance(dtype), rtol=0)


def kernel_levels() -> list[str]:
    """The builds this CPU runs: portable, AVX2, and AVX-512 where torch sees it."""
    levels = ["", "AVX2"]
    return [*levels, "AVX512"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else levels


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda lv: lv or "portable")
@pytest.mark.parametrize("head_dim", [40, 64, 128])  # the generic loop and both unrolled sizes
@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_each_kernel_build_reads_the_quantized_cache(level: str, head_dim: int, kv: str) -> None:
    case = quantized_case(MANY_DECODES, 2, 4, head_dim, 16, torch.bfloat16, KV_DTYPES[kv])
    backend = make_backend("kernel")
    backend._kernel = cpu_kernel.build(level)
    out = run_backend(backend, case)
    torch.testing.assert_close(out.float(), dense_attention(case), atol=3e-2, rtol=0)
    assert native.build_stem(cpu_kernel.SOURCE, level).startswith("cpu_decode.")


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_write_kv_stores_what_quantize_gives(kv: str) -> None:
    """Every backend's write lands each new token's quantized row at its slot, nothing else."""
    case = quantized_case([(3, 5), (0, 17)], 2, 1, 64, 16, torch.float32, KV_DTYPES[kv])
    before = case.k_cache.clone()
    ReferenceAttentionBackend().write_kv(
        case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping
    )
    flat = kv_quant.flat_pool(case.k_cache).view(torch.uint8)
    slots = case.meta.slot_mapping
    key = kv_rotation.rotate(case.key) if kv == "int8" else case.key  # fp8: unrotated
    expected = kv_quant.quantize(key, KV_DTYPES[kv]).view(torch.uint8)
    assert torch.equal(flat[slots], expected)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], kv_quant.flat_pool(before).view(torch.uint8)[untouched])
    cpu = make_backend("kernel")
    again = before.clone()
    cpu.write_kv(case.key, case.value, again, case.v_cache.clone(), slots)
    assert torch.equal(again.view(torch.uint8), case.k_cache.view(torch.uint8))
