"""Triton kernels against the reference backend, on CPU through the Triton interpreter.

Triton decides between compiling and interpreting when a kernel is decorated, i.e. when
worker_service.attention.triton_kernels is first imported, from TRITON_INTERPRET. So that
this works in any pytest run whatever was imported before, the kernel cases run in a
child pytest process started with TRITON_INTERPRET=1 (`test_kernels_under_interpreter`);
in that child (marked by TESSERA_TRITON_CHILD=1) the cases below are collected instead.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.attention_cases import (
    ATTENTION_CASES,
    BF16,
    F16,
    F32,
    TRITON_BATCHES,
    PagedCase,
    build_case,
)
from tests.worker.interpret import run_under_interpreter
from worker_service.attention.reference import ReferenceAttentionBackend

CHILD_FLAG = "TESSERA_TRITON_CHILD"
IN_CHILD = os.environ.get(CHILD_FLAG) == "1"

WRITE_CASES = [(F32, 16, 64), (BF16, 32, 64), (F16, 16, 128)]
TILE_CASES = [(16, 32), (64, 16)]  # (tile_n, block_size): tiles inside one block / spanning 4
# (batch, sliding window, query heads per kv head, block size): windows inside one key tile,
# across tiles and blocks, and longer than some requests
WINDOW_CASES = [
    (b, w, g, bs) for b in ("long", "mixed") for w in (1, 5, 40) for g in (1, 3) for bs in (16,)
]


def case_id(value: object) -> str | None:
    """Readable test ids for dtypes ("bfloat16" rather than "dtype3")."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


SOFTCAP_CASES = [("mixed", 0, 0.5), ("long", 5, 2.0)]  # (batch, window, softcap)
NUM_CHILD_TESTS = (
    len(ATTENTION_CASES) + len(WRITE_CASES) + len(TILE_CASES) + len(WINDOW_CASES)
    + len(SOFTCAP_CASES) + 1
)  # fmt: skip


def assert_close_for(dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Triton vs reference, both rounded to `dtype`: allow about two units in the last place."""
    tol = {F32: (1e-5, 1e-5), F16: (2e-3, 2e-3), BF16: (1e-2, 1.6e-2)}[dtype]
    torch.testing.assert_close(actual, expected, atol=tol[0], rtol=tol[1])


def reference_output(case: PagedCase, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Reference backend on copies of the pools (so the Triton run starts from the same state)."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    ref = ReferenceAttentionBackend()
    ref.write_kv(case.key, case.value, k_cache, v_cache, case.meta.slot_mapping)
    return ref.forward(case.query, k_cache, v_cache, case.meta, case.scale, window, softcap)


if IN_CHILD:
    from worker_service.attention import triton_kernels
    from worker_service.attention.triton_backend import TritonAttentionBackend

    def test_running_interpreted() -> None:
        assert triton_kernels.interpreted()

    @pytest.mark.parametrize(
        "batch,kv_heads,group,block_size,dtype,head_dim", ATTENTION_CASES, ids=case_id
    )
    def test_attention_matches_reference(
        batch: str, kv_heads: int, group: int, block_size: int, dtype: torch.dtype, head_dim: int
    ) -> None:
        requests = TRITON_BATCHES[batch]
        case = build_case(requests, kv_heads * group, kv_heads, head_dim, block_size, dtype)
        expected = reference_output(case)
        backend = TritonAttentionBackend()
        backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
        out = backend.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
        assert out.dtype == dtype and out.shape == case.query.shape
        assert_close_for(dtype, out, expected)

    @pytest.mark.parametrize("batch,window,group,block_size", WINDOW_CASES)
    def test_sliding_window_matches_reference(
        batch: str, window: int, group: int, block_size: int
    ) -> None:
        case = build_case(TRITON_BATCHES[batch], 2 * group, 2, 64, block_size, F32)
        expected = reference_output(case, window)
        backend = TritonAttentionBackend()
        backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
        out = backend.forward(
            case.query, case.k_cache, case.v_cache, case.meta, case.scale, window=window
        )
        assert_close_for(F32, out, expected)
        if window < 40:  # the window changed the result (it is not a full-attention run)
            assert not torch.allclose(out, reference_output(case), atol=1e-3)

    @pytest.mark.parametrize("batch,window,softcap", SOFTCAP_CASES)
    def test_softcap_matches_reference(batch: str, window: int, softcap: float) -> None:
        case = build_case(TRITON_BATCHES[batch], 6, 2, 64, 16, F32)
        expected = reference_output(case, window, softcap)
        backend = TritonAttentionBackend()
        backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
        out = backend.forward(
            case.query, case.k_cache, case.v_cache, case.meta, case.scale, window, softcap
        )
        assert_close_for(F32, out, expected)
        assert not torch.allclose(out, reference_output(case, window), atol=1e-3)

    @pytest.mark.parametrize("dtype,block_size,head_dim", WRITE_CASES, ids=case_id)
    def test_write_kv_matches_reference(dtype: torch.dtype, block_size: int, head_dim: int) -> None:
        """Strided K/V views (split from a fused QKV output) and a padding slot (-1)."""
        gen = torch.Generator().manual_seed(3)
        qkv = torch.randn(5, 9, head_dim, generator=gen).to(dtype)  # [tokens, 3+3+3 heads, dim]
        key, value = qkv[:, 3:6], qkv[:, 6:9]  # [5, 3, head_dim] views, not contiguous
        slots = torch.tensor([2 * block_size + 3, -1, 7, 4 * block_size - 1, block_size])
        pools = [torch.zeros(4, block_size, 3, head_dim, dtype=dtype) for _ in range(4)]
        ReferenceAttentionBackend().write_kv(key, value, pools[0], pools[1], slots)
        TritonAttentionBackend().write_kv(key, value, pools[2], pools[3], slots)
        assert torch.equal(pools[2], pools[0]) and torch.equal(pools[3], pools[1])
        assert int(pools[2].flatten(1).any(dim=1).sum()) >= 1  # something was written

    @pytest.mark.parametrize("tile_n,block_size", TILE_CASES)
    def test_tile_size_independent_of_block_size(tile_n: int, block_size: int) -> None:
        """Non-contiguous query (a view of a fused QKV output), tiles smaller or larger
        than a block."""
        case = build_case(TRITON_BATCHES["long"], 6, 2, 64, block_size)
        expected = reference_output(case)
        qkv = torch.cat([case.query, torch.zeros_like(case.query)], dim=1)  # [tokens, 12, 64]
        query = qkv[:, :6]
        TritonAttentionBackend().write_kv(
            case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping
        )
        out = torch.empty_like(case.query)
        meta = case.meta
        triton_kernels.paged_attention(
            out,
            query,
            case.k_cache,
            case.v_cache,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            case.scale,
            tile_n=tile_n,
        )
        assert_close_for(F32, out, expected)

else:

    @pytest.mark.slow
    def test_kernels_under_interpreter() -> None:
        """Runs this file's kernel cases in a child pytest with TRITON_INTERPRET=1."""
        run_under_interpreter(__file__, CHILD_FLAG, NUM_CHILD_TESTS)

    def test_cpu_tensors_rejected_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
        from worker_service.attention import triton_kernels
        from worker_service.attention.triton_backend import TritonAttentionBackend

        monkeypatch.setattr(triton_kernels, "interpreted", lambda: False)
        case = build_case([(3, 2)], 2, 2, 64, 16)
        with pytest.raises(RuntimeError, match="CUDA tensors"):
            TritonAttentionBackend().forward(
                case.query, case.k_cache, case.v_cache, case.meta, case.scale
            )

    def test_mismatched_dtypes_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
        from worker_service.attention import triton_kernels
        from worker_service.attention.triton_backend import TritonAttentionBackend

        monkeypatch.setattr(triton_kernels, "interpreted", lambda: True)  # pass device check
        case = build_case([(3, 2)], 2, 2, 64, 16)
        with pytest.raises(ValueError, match="one dtype"):
            TritonAttentionBackend().forward(
                case.query.bfloat16(), case.k_cache, case.v_cache, case.meta, case.scale
            )
