"""Q8_0 with each 16 weight rows interleaved (quant.Q8_0Rows, gguf_q8_rows.h): the layout is
the same bytes in another order, and its AVX512-VNNI GEMM computes gguf_q8.h's int8 products
(x quantized per 32 values) for any row count, with a tail of 16 weight rows, and bias."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_gguf_q8 import int8_reference, quantize_x
from tests.worker.test_small_gemm import _assert_float32_sums_rounded, _runnable_levels
from worker_service.models import cpu_ops, quant
from worker_service.models.layers import Linear

ROWS = [1, 2, 3, 4, 5, 8, 9, 17, 33]  # passes of 1-4 rows, sizes within one of each other
SHAPES = [(16, 32), (48, 96), (80, 576), (3072, 576), (576, 1536)]  # [N, K]: 16-row tails


def _vnni_ops() -> cpu_ops.CpuOps:
    if "AVX512_BF16" not in _runnable_levels():
        pytest.skip("the Q8_0 rows GEMM needs AVX512-VNNI (the AVX512_BF16 build)")
    return cpu_ops.build("AVX512_BF16")


def _q8_0(n: int, k: int, seed: int) -> quant.BlockWeight:
    torch.manual_seed(seed)
    return quant.BlockWeight.quantize_q8_0(torch.randn(n, k) * 0.05, None)


def test_the_layout_is_q8_0s_bytes_reordered() -> None:
    blocks = _q8_0(32, 96, 0).blocks
    rows = quant.interleave_q8_0(blocks)
    assert rows.shape == blocks.shape
    assert torch.equal(quant.deinterleave_q8_0(rows), blocks)
    raw, packed = blocks.reshape(32, 3, 34), rows.reshape(2, 3, 544)  # [row, block], [g, b]
    r, b, k = 21, 2, 13  # row 21 = group 1, lane 5; K value 13 = vector 3, byte 1
    assert torch.equal(packed[1, b, 2 * 5 : 2 * 5 + 2], raw[r, b, :2])  # its half scale
    assert packed[1, b, 32 + 64 * 3 + 4 * 5 + 1] == raw[r, b, 2 + k] ^ 0x80  # q + 128


def test_the_rows_dequantize_as_their_q8_0() -> None:
    weight = _q8_0(48, 64, 1)
    rows = quant.Q8_0Rows(quant.interleave_q8_0(weight.blocks), quant.Q8_0, 64, None)
    assert torch.equal(rows.dequantize(torch.float32), weight.dequantize(torch.float32))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_gemm_equals_the_int8_products(rows: int, n: int, k: int) -> None:
    ops = _vnni_ops()
    weight = _q8_0(n, k, rows * n + k)
    packed = quant.interleave_q8_0(weight.blocks)
    x, b = torch.randn(rows, k).bfloat16(), torch.randn(n).bfloat16()
    ours = ops.gemm_gguf(x, packed, quant.Q8_0_ROWS, b, path=cpu_ops.FAST)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, n)
    qx, dx = quantize_x(x)
    w = weight.dequantize(torch.float64)
    magnitude = (qx * dx).reshape(rows, k).double().abs() @ w.abs().T
    exact = int8_reference(x, weight.blocks, quant.Q8_0) + b.double()
    _assert_float32_sums_rounded(ours, exact, magnitude)


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    ops = _vnni_ops()
    packed = quant.interleave_q8_0(_q8_0(80, 192, 2).blocks)
    x = torch.randn(23, 192).bfloat16()
    together = ops.gemm_gguf(x, packed, quant.Q8_0_ROWS, None, path=cpu_ops.FAST)
    for r in (0, 6, 22):
        alone = ops.gemm_gguf(x[r : r + 1], packed, quant.Q8_0_ROWS, None, path=cpu_ops.FAST)
        among_7 = ops.gemm_gguf(x[r // 7 * 7 :][:7], packed, quant.Q8_0_ROWS, None)
        assert torch.equal(alone[0], together[r])
        assert torch.equal(among_7[r % 7], together[r])


def test_a_bf16_models_q8_0_linears_take_the_rows_where_their_gemm_runs() -> None:
    torch.manual_seed(3)
    linear = Linear(576, 64, bias=True)
    linear.bias.data = linear.bias.data.bfloat16()
    linear.quantize()
    assert linear.quant is not None and linear.quant.ops is not None
    q8_0, ops = linear.quant.blocks, linear.quant.ops
    linear.pack(torch.bfloat16)
    if not ops.q8_rows:
        assert linear.quant.blocks is q8_0  # kept as the file stores it
        return
    assert isinstance(linear.quant, quant.Q8_0Rows)
    x = torch.randn(5, 576).bfloat16()
    int8 = ops.gemm_gguf(x, q8_0, quant.Q8_0, linear.bias, path=cpu_ops.INT8)
    torch.testing.assert_close(linear(x), int8, rtol=2**-7, atol=1e-3)
    dense = x.float() @ linear.quant.dequantize(torch.float32).T  # float32 x: no C++ GEMM
    assert torch.equal(linear.quant.linear(x.float(), None), dense)


@pytest.mark.parametrize("level", [v for v in _runnable_levels() if v != "AVX512_BF16"])
def test_builds_without_the_gemm_keep_q8_0_and_refuse_the_layout(level: str) -> None:
    ops = cpu_ops.build(level)
    assert not ops.q8_rows
    weight = _q8_0(32, 64, 4)
    weight.ops = ops
    assert quant.for_bf16(weight) is weight
    with pytest.raises(ValueError, match="gemm_gguf"):
        ops.gemm_gguf(torch.randn(2, 64).bfloat16(), quant.interleave_q8_0(weight.blocks),
                      quant.Q8_0_ROWS, None, path=cpu_ops.FAST)  # fmt: skip
