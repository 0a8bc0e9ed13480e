"""The Triton kernels over a quantized KV cache (int8 / fp8_e4m3), on CPU through the
Triton interpreter (a child pytest under TRITON_INTERPRET=1, as test_attention_triton.py):
attention against dense float32 over the dequantized K/V, and the slot writer against the
reference backend's bytes."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.attention_cases import dense_attention
from tests.worker.interpret import run_under_interpreter
from tests.worker.test_kv_quant import KV_DTYPES, quantized_case, tolerance
from worker_service.attention import kv_quant
from worker_service.attention.reference import ReferenceAttentionBackend

CHILD_FLAG = "TESSERA_KV_QUANT_TRITON_CHILD"
IN_CHILD = os.environ.get(CHILD_FLAG) == "1"
F32, BF16 = torch.float32, torch.bfloat16
# Decodes at and across block boundaries, prefills with and without a cached prefix, and
# one long enough for several query blocks and key tiles.
REQUESTS = [(40, 1), (15, 1), (16, 1), (31, 1), (0, 9), (16, 5), (37, 30), (3, 1)]
# (kv dtype, query dtype, kv heads, query heads per kv head, block size, head_dim)
CASES = [
    *[(kv, F32, 2, g, 16, 64) for kv in sorted(KV_DTYPES) for g in (1, 3)],
    *[(kv, BF16, 2, 3, 16, 64) for kv in sorted(KV_DTYPES)],
    *[(kv, F32, 1, 8, 32, 128) for kv in sorted(KV_DTYPES)],
    ("int8", BF16, 2, 4, 32, 128),
]
NUM_CHILD_TESTS = len(CASES) + len(KV_DTYPES)


if IN_CHILD:
    from worker_service.attention import triton_kernels
    from worker_service.attention.triton_backend import TritonAttentionBackend

    @pytest.mark.parametrize("kv,dtype,kv_heads,group,block_size,head_dim", CASES, ids=str)
    def test_attention_over_quantized_kv_matches_dense(
        kv: str, dtype: torch.dtype, kv_heads: int, group: int, block_size: int, head_dim: int
    ) -> None:
        assert triton_kernels.interpreted()
        case = quantized_case(REQUESTS, kv_heads, group, head_dim, block_size, dtype, KV_DTYPES[kv])
        backend = TritonAttentionBackend()
        backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
        out = backend.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
        assert out.dtype == dtype and out.shape == case.query.shape
        atol = tolerance(dtype) if dtype == F32 else 3e-2  # tf32-free: interpreted dots are fp32
        torch.testing.assert_close(out.float(), dense_attention(case), atol=atol, rtol=0)

    @pytest.mark.parametrize("kv", sorted(KV_DTYPES))
    def test_write_kv_matches_reference_bytes(kv: str) -> None:
        """Strided K/V views (split from a fused QKV output) and a padding slot (-1)."""
        gen = torch.Generator().manual_seed(3)
        qkv = torch.randn(5, 9, 64, generator=gen)  # [tokens, 3+3+3 heads, dim]
        key, value = qkv[:, 3:6], qkv[:, 6:9]
        slots = torch.tensor([2 * 16 + 3, -1, 7, 4 * 16 - 1, 16])
        pools = [torch.zeros(4, 16, 3, 66, dtype=KV_DTYPES[kv]) for _ in range(4)]
        ReferenceAttentionBackend().write_kv(key, value, pools[0], pools[1], slots)
        TritonAttentionBackend().write_kv(key, value, pools[2], pools[3], slots)
        raw = [p.view(torch.uint8) for p in pools]
        assert torch.equal(raw[2], raw[0]) and torch.equal(raw[3], raw[1])
        assert int(raw[2].flatten(1).any(dim=1).sum()) == 4  # four slots written, one skipped
        assert kv_quant.is_quantized(pools[2])

else:

    def test_quantized_kv_kernels_under_interpreter() -> None:
        run_under_interpreter("tests/worker/test_kv_quant_triton.py", CHILD_FLAG, NUM_CHILD_TESTS)
