"""Batch-invariant mode's parts, bit for bit: a row's GEMM output alone and inside batches of
any size, a token's CPU attention alone, in a mixed batch, as a later chunk and as a decode,
and the row-wise ops (RMSNorm + residual, RoPE, SiLU * up, log-softmax) alone and batched;
bf16 and float32. The real model end to end: tests/offline/test_deterministic.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from benchmarks.attention_cases import PagedCase, build_case
from worker_service import batch_invariant
from worker_service.attention.base import AttentionBackend
from worker_service.attention.cpu import CpuAttentionBackend
from worker_service.models import cpu_ops
from worker_service.models.layers import Linear
from worker_service.models.rope import RotaryEmbedding

DTYPES = [torch.bfloat16, torch.float32]
BATCHES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 33, 100, 257]


def _linear(dtype: torch.dtype, k: int, n: int, packed: torch.dtype | str | None) -> Linear:
    torch.manual_seed(0)
    layer = Linear(k, n, bias=True)
    layer.weight.data = (torch.randn(n, k) * 0.05).to(dtype)
    layer.bias.data = torch.randn(n).to(dtype)
    if packed == "q8_0":
        layer.quantize()  # weight-only int8 blocks: the GGUF GEMM kernels
    elif isinstance(packed, torch.dtype):
        layer.pack(packed)
    layer.tile_rows = batch_invariant.TILE_ROWS
    return layer


# (weight dtype, packed GEMM dtype): plain F.linear, oneDNN bf16, bf16 weights as float32
# GEMMs (AVX2's path), oneDNN float32 (whose reduction changes with the rows untiled).
GEMMS = [
    (torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, None),
    (torch.float32, torch.float32),
    (torch.bfloat16, "q8_0"),
    (torch.float32, "q8_0"),
]


@pytest.mark.parametrize(("dtype", "packed"), GEMMS)
@pytest.mark.parametrize(("k", "n"), [(576, 1728), (1536, 576)])
def test_a_rows_gemm_output_does_not_depend_on_its_batch(
    dtype: torch.dtype, packed: torch.dtype | str | None, k: int, n: int
) -> None:
    if packed == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN bf16 GEMMs need AVX512-BW/VL/DQ or AVX-NE-CONVERT (AVX2 packs fp32)")
    layer = _linear(dtype, k, n, packed)
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, k, generator=gen).to(dtype)
    with torch.inference_mode():
        alone = layer(row)
        for m in BATCHES:
            for pos in {0, m // 2, m - 1}:
                batch = torch.randn(m, k, generator=gen).to(dtype)
                batch[pos] = row[0]
                assert torch.equal(layer(batch)[pos], alone[0]), (m, pos)


def test_tiles_compute_what_the_untiled_gemm_does_up_to_rounding() -> None:
    layer = _linear(torch.float32, 576, 1728, torch.float32)
    x = torch.randn(37, 576)
    with torch.inference_mode():
        tiled = layer(x)
        layer.tile_rows = 0
        torch.testing.assert_close(tiled, layer(x), rtol=1e-5, atol=1e-5)
    assert tiled.shape == (37, 1728)


def _backend() -> CpuAttentionBackend:
    backend = CpuAttentionBackend()
    if not backend.decode_kernel:
        pytest.skip("the CPU decode kernel does not build here")
    backend.make_batch_invariant()
    backend.split_tokens = 64  # fixed splits within these short contexts, merged
    return backend


def _attend(
    backend: AttentionBackend, case: PagedCase, query: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """Write the case's new K/V, then attend `query` (its new tokens' rows)."""
    backend.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    return backend.forward(query, case.k_cache, case.v_cache, case.meta, case.scale, window)


L = 200  # the request under test: a prompt of L tokens


def _as_request0(case: PagedCase, alone: PagedCase, cached: int) -> torch.Tensor:
    """Give `case`'s request 0 (`cached` tokens in the pool, then new ones) the K/V of
    `alone`'s request; returns the query rows of its new tokens."""
    pos = torch.arange(cached)
    table = case.meta.block_table[0].long()
    slots = table[pos // 16] * 16 + pos % 16
    kv_heads, dim = case.k_cache.shape[2:]
    case.k_cache.view(-1, kv_heads, dim)[slots] = alone.key[:cached]
    case.v_cache.view(-1, kv_heads, dim)[slots] = alone.value[:cached]
    new = L - cached
    case.key[:new], case.value[:new] = alone.key[cached:], alone.value[cached:]
    return alone.query[cached:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 48])
def test_a_tokens_attention_does_not_depend_on_batch_chunks_or_decode(
    dtype: torch.dtype, window: int
) -> None:
    check_attention_invariance(_backend(), dtype, window)


def check_attention_invariance(
    backend: AttentionBackend, dtype: torch.dtype, window: int
) -> torch.Tensor:
    """Request 0's L-token prompt attended alone, first in a mixed batch, and as a decode of
    its last token or a later chunk after a cached prefix (with another request beside it):
    bit-identical rows. Returns the alone output [L, heads, dim]."""
    alone_case = build_case([(0, L)], 6, 2, 64, 16, dtype)
    alone = _attend(backend, alone_case, alone_case.query, window)  # [L, heads, dim]
    mixed = build_case([(0, L), (300, 1), (5, 7), (70, 1)], 6, 2, 64, 16, dtype, seed=1)
    mixed.query[:L] = _as_request0(mixed, alone_case, 0)
    assert torch.equal(_attend(backend, mixed, mixed.query, window)[:L], alone)
    for cached in (L - 1, 150, 24):  # a decode of the last token; later chunks after a prefix
        case = build_case([(cached, L - cached), (40, 3)], 6, 2, 64, 16, dtype, seed=2)
        query = torch.cat([_as_request0(case, alone_case, cached), case.query[L - cached :]])
        out = _attend(backend, case, query, window)[: L - cached]
        assert torch.equal(out, alone[cached:]), cached
    return alone


def test_batch_invariant_attention_matches_the_default_path_up_to_rounding() -> None:
    case = build_case([(0, 40), (100, 1), (10, 5)], 6, 2, 64, 16, torch.float32)
    fast = _attend(CpuAttentionBackend(), case, case.query)
    torch.testing.assert_close(_attend(_backend(), case, case.query), fast, rtol=1e-5, atol=1e-5)


def _rows_alone_equal_batched(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """fn's output row i for x's row i alone equals its row i of the whole batch."""
    batched = fn(x)
    for i in (0, x.shape[0] // 2, x.shape[0] - 1):
        assert torch.equal(fn(x[i : i + 1].clone())[0], batched[i]), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_row_wise_ops_are_batch_invariant(dtype: torch.dtype) -> None:
    ops = cpu_ops.load()
    x = torch.randn(33, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    logits = torch.randn(33, 49152) * 5
    _rows_alone_equal_batched(lambda t: torch.log_softmax(t, dim=-1), logits)
    _rows_alone_equal_batched(lambda t: t.argmax(dim=-1, keepdim=True), logits)
    if ops is None:
        return
    _rows_alone_equal_batched(lambda t: ops.add_rms_norm(t, None, weight, 1e-5)[0], x)
    _rows_alone_equal_batched(lambda t: ops.silu_mul(t), x)
    qk = torch.randn(33, 12, 64).to(dtype)
    angles = torch.randn(33, 1, 32)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def rope(t: torch.Tensor) -> torch.Tensor:
        rows = slice(0, 33) if t.shape[0] == 33 else _row_of(t, qk)
        t = t.clone()
        ops.rope_(t, cos[rows].contiguous(), sin[rows].contiguous())
        return t

    _rows_alone_equal_batched(rope, qk)
    torch.testing.assert_close(rope(qk), RotaryEmbedding.rotate(qk, (cos, sin)))


def _row_of(row: torch.Tensor, batch: torch.Tensor) -> slice:
    """The slice of `batch` whose one row equals `row` ([1, ...])."""
    i = next(i for i in range(batch.shape[0]) if torch.equal(batch[i], row[0]))
    return slice(i, i + 1)


def test_parts_without_a_batch_invariant_form_are_refused() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        batch_invariant.make_batch_invariant(
            torch.nn.Sequential(), CpuAttentionBackend(), torch.device("cuda")
        )
    vision = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="cannot tile"):
        batch_invariant.make_batch_invariant(vision, CpuAttentionBackend(), torch.device("cpu"))
