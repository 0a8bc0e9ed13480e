"""The prefill attention kernel (amx_prefill.h) against dense causal attention in float32, on
each engine this CPU runs (AMX tiles; AVX512-BF16 dot products, prefill_dots.h, which tests
choose: cpu_kernel.choose_prefill_engine says why it is not the default): through the
CPU backend (prompts, chunks after a cached prefix, several per step), over bf16 and
quantized pools (int8, fp8), and called alone at long contexts; GQA groups 1-8, head sizes
32-256, block sizes 8-32, query tiles and key steps cut at every boundary. Unused pool slots
hold NaN, so a read outside a request's K/V shows. An engine skips, and says so, where the
CPU lacks it (tiles: AMX; dots: AVX512-BF16)."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator

import pytest
import torch

from benchmarks.attention_cases import build_case, dense_attention, tolerance
from tests.worker.test_kv_quant import KV_DTYPES, quantized_case, run_backend
from tests.worker.test_kv_quant import tolerance as quantized_tolerance
from worker_service.attention import cpu_kernel
from worker_service.attention.cpu import CpuAttentionBackend

# (cached prefix, new tokens): tiles of 16 rows and steps of 32 keys cut before, at and after
# their ends; a decode row (1 new token) rides along on the decode kernel.
PREFILLS = [(0, 2), (0, 15), (0, 16), (0, 17), (0, 33), (31, 2), (32, 16), (45, 70), (3, 1)]


NEEDS = {"tiles": "a CPU with AMX tiles for bf16 (amx_tile, amx_bf16)", "dots": "AVX512-BF16"}


@pytest.fixture(scope="module", params=["tiles", "dots"])
def lib(request: pytest.FixtureRequest) -> Iterator[ctypes.CDLL]:
    """The library with request.param's engine chosen (the backends built meanwhile take it)."""
    lib = cpu_kernel.load()
    if lib is None or cpu_kernel.choose_prefill_engine(lib, request.param) != request.param:
        pytest.skip(f"the {request.param} engine needs {NEEDS[request.param]}")
    yield lib
    cpu_kernel.choose_prefill_engine(lib, "tiles")  # back to the default


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_backend_prefills_match_dense(
    lib: ctypes.CDLL, group: int, head_dim: int, block_size: int
) -> None:
    case = build_case(PREFILLS, 2 * group, 2, head_dim, block_size, torch.bfloat16)
    backend = CpuAttentionBackend()
    assert backend._prefill_kernel is lib  # the kernel runs: no silent SDPA fallback
    backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = backend.forward(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    want = dense_attention(case)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want, atol=tolerance(torch.bfloat16), rtol=0)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_quantized_pools_match_dense(lib: ctypes.CDLL, kv: str, group: int, head_dim: int) -> None:
    """int8 / fp8 pools (K Hadamard-rotated for int8) widened to bf16 as they are packed."""
    case = quantized_case(PREFILLS, 2, group, head_dim, 16, torch.bfloat16, KV_DTYPES[kv])
    backend = CpuAttentionBackend()
    assert backend._prefill_kernel is lib
    out = run_backend(backend, case)
    tol = quantized_tolerance(torch.bfloat16)
    torch.testing.assert_close(out.float(), dense_attention(case), atol=tol, rtol=0)


@pytest.mark.parametrize(
    "prefix,new,group",
    [(0, 4096, 3), (4000, 96, 3), (1000, 517, 5), (2047, 2, 7), (0, 1, 2)],
)
def test_long_contexts(lib: ctypes.CDLL, prefix: int, new: int, group: int) -> None:
    gen = torch.Generator().manual_seed(prefix + new)
    kv_heads, head_dim, block_size, seq_len = 2, 64, 16, prefix + new
    blocks = -(-seq_len // block_size)
    pool = (blocks + 5, block_size, kv_heads, head_dim)
    k_cache = torch.randn(pool, generator=gen).bfloat16()
    v_cache = torch.randn(pool, generator=gen).bfloat16()
    table = torch.randperm(blocks + 5, generator=gen)[:blocks].int()
    query = torch.randn(new, kv_heads * group, head_dim, generator=gen).bfloat16()
    scale = 1 / math.sqrt(head_dim)
    out = cpu_kernel.paged_prefill(lib, query, k_cache, v_cache, table, seq_len, scale)
    k = k_cache[table.long()].reshape(-1, kv_heads, head_dim)[:seq_len].float()
    v = v_cache[table.long()].reshape(-1, kv_heads, head_dim)[:seq_len].float()
    causal = torch.arange(seq_len)[None] <= torch.arange(new)[:, None] + prefix  # [new, seq]
    want = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1),  # [heads, new, dim]
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=causal,
        scale=scale,
    ).transpose(0, 1)
    # Long rows average many values down: one bf16 step (2^-7) of the largest output.
    atol = 2**-7 * want.abs().max().item()
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


def test_rejects_head_sizes_off_the_tiles(lib: ctypes.CDLL) -> None:
    pool = torch.zeros(2, 16, 1, 48, dtype=torch.bfloat16)
    query = torch.zeros(4, 1, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="status 2"):
        cpu_kernel.paged_prefill(lib, query, pool, pool, torch.zeros(1, dtype=torch.int32), 4, 1.0)


def test_hf_kernels_keep_sdpa() -> None:
    backend = CpuAttentionBackend()
    backend.match_hf_kernels()
    assert backend._prefill_kernel is None
