"""Q4_0, Q4_1 and Q8_0 with each 16 weight rows interleaved (quant.RowsWeight,
gguf_q8_rows.h): the layout is the same bytes in another order, and its GEMM (AVX512-VNNI:
every format; AVX2: Q4_0 and Q4_1) computes gguf_q8.h's int8 products (x quantized per 32
values) for any row count, with a tail of 16 weight rows, and bias, on every build this CPU
runs; on AMX CPUs many rows take the bf16 tiles (amx_q8_rows.h)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_gguf_q8 import assert_int8_products, assert_rows_independent
from tests.worker.test_small_gemm import _runnable_levels, random_blocks
from worker_service.models import cpu_ops, quant
from worker_service.models.layers import Linear
from worker_service.models.quant_int4 import quantize_q4_1

FORMATS = [quant.Q4_0, quant.Q4_1, quant.Q8_0]
ROWS = [1, 2, 3, 4, 5, 8, 9, 17, 33]  # passes of 1-4 rows, sizes within one of each other
SHAPES = [(16, 32), (48, 96), (80, 576), (3072, 576), (576, 1536)]  # [N, K]: 16-row tails


# ggml types whose rows layout each build multiplies (the others: none)
TAKES = {"AVX2": {quant.Q4_0, quant.Q4_1}, "AVX512_BF16": set(FORMATS)}
LEVELS = [v for v in _runnable_levels() if v in TAKES]


def _rows_ops(level: str, ggml_type: int) -> cpu_ops.CpuOps:
    if ggml_type not in TAKES[level]:
        pytest.skip(f"the {level or 'portable'} build has no GEMM over this layout")
    return cpu_ops.build(level)


def _blocks(ggml_type: int, n: int, k: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return random_blocks(ggml_type, n, k)


@pytest.mark.parametrize("ggml_type", FORMATS, ids=str)
def test_the_layout_is_the_blocks_bytes_reordered(ggml_type: int) -> None:
    blocks = _blocks(ggml_type, 48, 96, ggml_type)
    rows = quant.interleave(blocks, ggml_type)
    assert rows.shape == blocks.shape and not torch.equal(rows, blocks)
    assert torch.equal(quant.deinterleave(rows, ggml_type), blocks)


def test_where_a_q8_0_value_and_scale_go() -> None:
    blocks = _blocks(quant.Q8_0, 32, 96, 0)
    raw, packed = blocks.reshape(32, 3, 34), quant.interleave(blocks, quant.Q8_0)
    packed = packed.reshape(2, 3, 544)  # [16-row group, block, bytes]
    r, b, k = 21, 2, 13  # row 21 = group 1, lane 5; K value 13 = vector 3, byte 1
    assert torch.equal(packed[1, b, 2 * 5 : 2 * 5 + 2], raw[r, b, :2])  # its half scale
    assert packed[1, b, 32 + 64 * 3 + 4 * 5 + 1] == raw[r, b, 2 + k] ^ 0x80  # q + 128


def test_where_a_q4_1_value_and_its_scales_go() -> None:
    blocks = _blocks(quant.Q4_1, 16, 32, 1)
    raw, packed = blocks.reshape(16, 20), quant.interleave(blocks, quant.Q4_1).reshape(320)
    r, k = 9, 21  # value 21: ggml's byte 5, high nibble; here vector 2, byte 1, high
    p, e = k // 8, k % 4
    assert torch.equal(packed[2 * r : 2 * r + 2], raw[r, :2])  # d
    assert torch.equal(packed[32 + 2 * r : 32 + 2 * r + 2], raw[r, 2:4])  # m
    assert packed[64 + 64 * p + 4 * r + e] >> 4 == raw[r, 4 + k - 16] >> 4


@pytest.mark.parametrize("ggml_type", FORMATS, ids=str)
def test_the_rows_dequantize_as_their_blocks(ggml_type: int) -> None:
    blocks = _blocks(ggml_type, 48, 64, 2)
    rows = quant.RowsWeight(quant.interleave(blocks, ggml_type), ggml_type, 64, None)
    plain = quant.BlockWeight(blocks, ggml_type, 64, None)
    assert torch.equal(rows.dequantize(torch.float32), plain.dequantize(torch.float32))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("ggml_type", FORMATS, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_the_gemm_equals_the_int8_products(
    level: str, ggml_type: int, rows: int, n: int, k: int
) -> None:
    ops = _rows_ops(level, ggml_type)
    blocks = _blocks(ggml_type, n, k, rows * n + k)
    native = quant.ROWS_TYPES[ggml_type]
    x, b = torch.randn(rows, k).bfloat16(), torch.randn(n).bfloat16()
    ours = ops.gemm_gguf(x, quant.interleave(blocks, ggml_type), native, b, path=cpu_ops.INT8)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
    assert_int8_products(ours, x, blocks, ggml_type, b)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("ggml_type", FORMATS, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_fast_is_int8_below_the_tiles_and_the_blocks_tile_gemm_from_them(
    level: str, ggml_type: int, n: int, k: int
) -> None:
    """FAST multiplies int8 x (INT8's bits) except on AMX CPUs from ROWS_TILE_ROWS rows:
    there each 32 weight rows are dequantized to bf16 for the tiles (amx_q8_rows.h), the same
    weights and bits as the blocks' own tile GEMM (amx_gguf.h, held to the dense product in
    test_amx_gguf.py), and a row's bits do not depend on the other rows."""
    ops = _rows_ops(level, ggml_type)
    blocks = _blocks(ggml_type, n, k, n + k)
    packed, native = quant.interleave(blocks, ggml_type), quant.ROWS_TYPES[ggml_type]
    first, b = cpu_ops.ROWS_TILE_ROWS[ggml_type], torch.randn(n).bfloat16()
    x = torch.randn(first + 37, k).bfloat16()
    for rows in (1, first - 1, first, first + 1, first + 37):
        fast = ops.gemm_gguf(x[:rows], packed, native, b, cpu_ops.FAST)
        tiles = ops.amx and rows >= first
        want = ops.gemm_gguf(x[:rows], *((blocks, ggml_type) if tiles else (packed, native)), b,
                             cpu_ops.FAST if tiles else cpu_ops.INT8)  # fmt: skip
        assert torch.equal(fast, want)
    tail = ops.gemm_gguf(x[-first:], packed, native, b, cpu_ops.FAST)
    assert torch.equal(tail, fast[-first:])


@pytest.mark.parametrize("ggml_type", FORMATS, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_a_rows_result_does_not_depend_on_the_other_rows(level: str, ggml_type: int) -> None:
    ops = _rows_ops(level, ggml_type)
    packed = quant.interleave(_blocks(ggml_type, 80, 192, 3), ggml_type)
    native = quant.ROWS_TYPES[ggml_type]
    x = torch.randn(23, 192).bfloat16()
    assert_rows_independent(lambda v: ops.gemm_gguf(v, packed, native, None, cpu_ops.INT8), x)


@pytest.mark.parametrize("ggml_type", [quant.Q4_1, quant.Q8_0], ids=str)
def test_a_bf16_models_linears_take_the_rows_where_their_gemm_runs(ggml_type: int) -> None:
    """int8 (Q8_0) and int4 (Q4_1) at load, then the bf16 model's pack."""
    torch.manual_seed(4)
    linear = Linear(576, 64, bias=True)
    linear.bias.data = linear.bias.data.bfloat16()
    ops = cpu_ops.load()
    if ggml_type == quant.Q8_0:
        linear.quantize()
    else:
        linear.set_blocks(quantize_q4_1(linear.weight.data, 32, ops))
    assert linear.quant is not None and linear.quant.ops is ops is not None
    blocks = linear.quant.blocks
    linear.pack(torch.bfloat16)
    if not ops.q8_rows(quant.ROWS_TYPES[ggml_type]):
        assert linear.quant.blocks is blocks  # kept as the file stores them
        return
    assert isinstance(linear.quant, quant.RowsWeight)
    x = torch.randn(5, 576).bfloat16()
    int8 = ops.gemm_gguf(x, blocks, ggml_type, linear.bias, path=cpu_ops.INT8)
    torch.testing.assert_close(linear(x), int8, rtol=2**-7, atol=1e-3)
    dense = x.float() @ linear.quant.dequantize(torch.float32).T  # float32 x: no C++ GEMM
    assert torch.equal(linear.quant.linear(x.float(), None), dense)


def test_other_formats_and_odd_row_counts_keep_their_blocks() -> None:
    ops = cpu_ops.load()
    assert ops is not None
    for ggml_type, n in ((quant.Q6_K, 32), (quant.Q8_0, 24)):
        weight = quant.BlockWeight(_blocks(ggml_type, n, 256, 5), ggml_type, 256, ops)
        assert quant.for_bf16(weight) is weight


@pytest.mark.parametrize("ggml_type", FORMATS, ids=str)
@pytest.mark.parametrize("level", _runnable_levels())
def test_builds_without_the_gemm_keep_the_blocks_and_refuse_the_layout(
    level: str, ggml_type: int
) -> None:
    ops = cpu_ops.build(level)
    takes = ggml_type in TAKES.get(level, set())
    assert ops.q8_rows(quant.ROWS_TYPES[ggml_type]) == takes
    if takes:
        return
    weight = quant.BlockWeight(_blocks(ggml_type, 32, 64, 6), ggml_type, 64, ops)
    assert quant.for_bf16(weight) is weight
    with pytest.raises(ValueError, match="gemm_gguf"):
        ops.gemm_gguf(torch.randn(2, 64).bfloat16(), quant.interleave(weight.blocks, ggml_type),
                      quant.ROWS_TYPES[ggml_type], None, path=cpu_ops.FAST)  # fmt: skip
