"""The CPU attention backend against dense causal attention on unpaged tensors: decode by
the C++ paged kernel (the default), by SDPA with the heads folded per KV head, and by HF's
own call (`match_hf_kernels`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.attention_cases import BATCHES, build_case, dense_attention, tolerance
from worker_service.attention import cpu_kernel
from worker_service.attention.cpu import DECODE_GROUP, CpuAttentionBackend

# Enough decode requests of scattered lengths to be split into length groups, plus prefills.
MANY_DECODES = [((7 * i) % 53 + 1, 1) for i in range(2 * DECODE_GROUP + 5)] + [(9, 4), (0, 6)]

# Unused pool slots hold this instead of NaN: a read outside a request's KV would show, and a
# masked one must weigh nothing (a NaN there would poison even a zero-weighted sum).
FAR = 1e4


def make_backend(mode: str) -> CpuAttentionBackend:
    backend = CpuAttentionBackend(decode_kernel=mode == "kernel")
    if mode == "hf-call":
        backend.match_hf_kernels()
    assert backend.decode_kernel == (mode == "kernel")  # the kernel built: no silent fallback
    return backend


@pytest.mark.parametrize("mode", ["kernel", "sdpa-folded", "hf-call"])
@pytest.mark.parametrize("batch", [*sorted(BATCHES), "many_decodes"])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_backend_matches_dense(
    mode: str, batch: str, num_kv_heads: int, group: int, block_size: int, dtype: torch.dtype
) -> None:
    check(mode, batch, num_kv_heads, group, 64, block_size, dtype)


@pytest.mark.parametrize("head_dim", [40, 128])  # the kernel's generic and other unrolled size
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_kernel_head_sizes(head_dim: int, dtype: torch.dtype) -> None:
    check("kernel", "many_decodes", 2, 3, head_dim, 16, dtype)


@pytest.mark.parametrize("group", [4, 7, 8])  # register-held sums up to 6 heads, then a loop
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_kernel_group_sizes(group: int, head_dim: int, dtype: torch.dtype) -> None:
    check("kernel", "many_decodes", 1, group, head_dim, 32, dtype)


def check(
    mode: str,
    batch: str,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    requests = MANY_DECODES if batch == "many_decodes" else BATCHES[batch]
    case = build_case(requests, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype)
    case.k_cache.nan_to_num_(FAR)
    case.v_cache.nan_to_num_(FAR)
    backend = make_backend(mode)
    backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = backend.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == case.query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), dense_attention(case), atol=tolerance(dtype), rtol=0)


def test_kernel_builds_into_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    stale = tmp_path / "kernels" / "cpu_decode-0000000000000000.so"
    stale.parent.mkdir()
    stale.write_bytes(b"")
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is not None
        built = list(stale.parent.iterdir())
        assert len(built) == 1 and built[0].name.startswith("cpu_decode-")
        assert not stale.exists()  # builds of other sources are pruned
    finally:
        cpu_kernel.load.cache_clear()


def test_no_compiler_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernel.load.cache_clear()
    try:
        backend = CpuAttentionBackend()
        assert not backend.decode_kernel
        case = build_case(MANY_DECODES, 6, 2, 64, 16, torch.float32)
        case.k_cache.nan_to_num_(FAR)
        case.v_cache.nan_to_num_(FAR)
        backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
        out = backend.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
        torch.testing.assert_close(
            out, dense_attention(case), atol=tolerance(torch.float32), rtol=0
        )
    finally:
        cpu_kernel.load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_verify_rows_run_as_decode_rows_of_the_kernel(dtype: torch.dtype) -> None:
    """Speculative decoding: requests verifying drafts (meta.verify_reqs) attend each new
    token as a causal decode row of the paged kernel; same result as dense attention."""
    requests = [(40, 1), (37, 5), (3, 1), (16, 3), (0, 6)]  # 1 and 3 verify drafts
    case = build_case(requests, 6, 2, 64, 16, dtype)
    case.k_cache.nan_to_num_(FAR)
    case.v_cache.nan_to_num_(FAR)
    case.meta.verify_reqs = [1, 3]
    backend = make_backend("kernel")
    backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = backend.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    plan = backend._get_plan(case.meta, 16, True, 0)
    assert plan.kernel_decode is not None and len(plan.kernel_decode.rows) == 2 + 5 + 3
    assert len(plan.prefills) == 1  # only the real prefill
    torch.testing.assert_close(out.float(), dense_attention(case), atol=tolerance(dtype), rtol=0)


@pytest.mark.parametrize("mode", ["kernel", "sdpa-folded", "hf-call"])
@pytest.mark.parametrize("batch", ["mixed", "prefill_with_prefix", "many_decodes"])
@pytest.mark.parametrize("window", [1, 7, 20])  # within a block, across blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliding_window_matches_reference(
    mode: str, batch: str, window: int, dtype: torch.dtype
) -> None:
    """Each token sees only its last `window` keys; unused and out-of-window slots hold FAR
    (as blocks freed and reused by other requests hold other values)."""
    from worker_service.attention.reference import ReferenceAttentionBackend

    requests = MANY_DECODES if batch == "many_decodes" else BATCHES[batch]
    case = build_case(requests, 6, 2, 64, 16, dtype)
    case.k_cache.nan_to_num_(FAR)
    case.v_cache.nan_to_num_(FAR)
    ref = ReferenceAttentionBackend()
    pools = case.k_cache.clone(), case.v_cache.clone()
    ref.write_kv(case.key, case.value, *pools, case.meta.slot_mapping)
    expected = ref.forward(case.query, *pools, case.meta, case.scale, window=window)
    backend = make_backend(mode)
    backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    full = backend.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    out = backend.forward(
        case.query, case.k_cache, case.v_cache, case.meta, case.scale, window=window
    )
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance(dtype), rtol=0)
    assert not torch.allclose(out.float(), full.float(), atol=1e-2)  # the window mattered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 5, 2048])
def test_scatter_rows_is_index_copy(dtype: torch.dtype, n: int) -> None:
    """The KV write: strided rows (K's columns of a qkv output) into shuffled pool slots."""
    lib = cpu_kernel.load()
    assert lib is not None
    torch.manual_seed(n)
    qkv = torch.randn(n, 15, 64).to(dtype)
    key = qkv[:, 9:12]  # [n, 3, 64], rows 15 * 64 elements apart
    slots = torch.randperm(3 * n)[:n]
    ours, expected = (torch.zeros(3 * n, 3, 64, dtype=dtype) for _ in range(2))
    cpu_kernel.scatter_rows(lib, key, ours, slots)
    expected.index_copy_(0, slots, key)
    assert torch.equal(ours, expected)


def test_scatter_rows_refuses_a_slot_outside_the_pool() -> None:
    lib = cpu_kernel.load()
    assert lib is not None
    pool = torch.zeros(8, 3, 64)
    rows = torch.ones(2, 3, 64)
    for bad in (8, -1):
        with pytest.raises(IndexError, match="outside the pool of 8"):
            cpu_kernel.scatter_rows(lib, rows, pool, torch.tensor([0, bad]))
        assert not pool.any()  # nothing written, not even the good row
