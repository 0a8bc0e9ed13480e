"""The GGUF GEMM with int8 activations (gguf_q8.h, the bf16 fast path): x quantized per 32
values as llama.cpp's Q8_0 (d_x = max |x| / 127, q_x = round(x / d_x)), integer dot
products with the blocks' values, against a float64 evaluation of the same quantized
products on every build this CPU runs; builds without AVX2 keep the float path exactly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.worker.test_small_gemm import (
    _assert_float32_sums_rounded,
    _runnable_levels,
    random_blocks,
)
from worker_service.models import cpu_ops, quant
from worker_service.models.layers import Linear

ROWS = [1, 3, 8, 17, 40]  # one, a few, a full block of 8 rows, blocks and a tail
OFFSET_OF = {quant.Q4_0: lambda d, raw: -8 * d, quant.Q8_0: lambda d, raw: 0 * d}


@pytest.fixture(scope="module", params=_runnable_levels(), ids=lambda v: v or "portable")
def level(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, K] -> q_x [rows, K / 32, 32] and d_x [rows, K / 32, 1], in float32 as the kernel."""
    xb = x.float().reshape(x.shape[0], -1, quant.BLOCK)
    d = xb.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv), d


def int8_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """sum over blocks of d d_x sum(q q_x) + m sum(x), in float64."""
    n = blocks.shape[0]
    raw = blocks.reshape(n, -1, quant.BLOCK_BYTES[ggml_type])
    d = raw[..., 0:2].contiguous().view(torch.float16).double()  # [n, blocks, 1]
    if ggml_type == quant.Q4_1:
        m = raw[..., 2:4].contiguous().view(torch.float16).double()
    else:
        m = OFFSET_OF[ggml_type](d, raw)
    w = quant.dequantize_blocks(blocks, ggml_type).double().reshape(n, -1, quant.BLOCK)
    qx, dx = quantize_x(x)
    dot = torch.einsum("rbk,nbk,rb->rn", qx.double(), w - m, dx.double().squeeze(2))
    xsum = x.double().reshape(x.shape[0], -1, quant.BLOCK).sum(dim=2)  # [rows, blocks]
    return dot + xsum @ m.squeeze(2).T


def assert_int8_products(
    ours: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor
) -> None:
    """ours = x @ blocks.T + bias with x quantized per 32 values, the sums in float32."""
    qx, dx = quantize_x(x)
    w = quant.dequantize_blocks(blocks, ggml_type).double()
    magnitude = (qx * dx).reshape(x.shape).double().abs() @ w.abs().T + x.double().abs() @ (
        w.abs().T
    )
    exact = int8_reference(x, blocks, ggml_type) + bias.double()
    _assert_float32_sums_rounded(ours, exact, magnitude)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (67, 96), (3072, 576), (576, 1536)])
@pytest.mark.parametrize("ggml_type", [quant.Q4_0, quant.Q4_1, quant.Q8_0], ids=str)
def test_int8_activations_equal_the_quantized_products(
    level: str, ggml_type: int, dtype: torch.dtype, rows: int, n: int, k: int
) -> None:
    ops = cpu_ops.build(level)
    torch.manual_seed(rows * n + k)
    blocks = random_blocks(ggml_type, n, k)
    x, b = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    ours = ops.gemm_gguf(x, blocks, ggml_type, b, path=cpu_ops.INT8)
    assert ours.dtype == dtype
    if level == "":  # no integer dot products in the portable build: the float path
        assert torch.equal(ours, ops.gemm_gguf(x, blocks, ggml_type, b))
        return
    assert_int8_products(ours, x, blocks, ggml_type, b)


@pytest.mark.parametrize("ggml_type", [quant.Q4_0, quant.Q4_1, quant.Q8_0], ids=str)
def test_a_rows_int8_result_does_not_depend_on_the_other_rows(level: str, ggml_type: int) -> None:
    """Each row of x takes the same sums alone, among 7 rows or among 20 (Q4 blocks go 16
    weight rows a pass with VNNI, 8 with AVX2, gguf_q8_wide.h: 83 columns end in a tail of 3
    single columns either way)."""
    if level == "":
        pytest.skip("no integer dot products in the portable build: the float path")
    ops = cpu_ops.build(level)
    torch.manual_seed(ggml_type)
    blocks = random_blocks(ggml_type, 83, 192)
    x = torch.randn(20, 192).bfloat16()
    assert_rows_independent(lambda v: ops.gemm_gguf(v, blocks, ggml_type, None, cpu_ops.INT8), x)


def assert_rows_independent(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """Rows first, middle and last of x take the same bits alone, among 7 and among all."""
    together = gemm(x)
    for r in (0, 6, x.shape[0] - 1):
        assert torch.equal(gemm(x[r : r + 1])[0], together[r])
        assert torch.equal(gemm(x[r // 7 * 7 :][:7])[r % 7], together[r])


def test_int8_activations_stay_close_to_the_float_product() -> None:
    """Quantizing x costs about 1/254 of each block's largest value, no more (Q8_0 weights)."""
    ops = cpu_ops.load()
    if ops is None:
        pytest.fail("the C++ ops did not build")
    torch.manual_seed(0)
    x, w = torch.randn(4, 576), torch.randn(300, 576)
    blocks = quant.BlockWeight.quantize_q8_0(w, ops).blocks
    exact = x.double() @ quant.dequantize_blocks(blocks, quant.Q8_0).double().T
    error = (ops.gemm_gguf(x, blocks, quant.Q8_0, None, path=cpu_ops.INT8).double() - exact).abs()
    assert error.max() < 0.02 * exact.abs().max()


def test_bf16_linears_take_the_fast_path_float32_ones_the_exact_one() -> None:
    torch.manual_seed(1)
    linear = Linear(576, 64, bias=False)
    linear.quantize()
    assert linear.quant is not None and linear.quant.ops is not None
    x = torch.randn(3, 576)
    ops, blocks = linear.quant.ops, linear.quant.blocks
    assert torch.equal(linear(x), ops.gemm_gguf(x, blocks, quant.Q8_0, None))
    xb = x.bfloat16()
    assert torch.equal(linear(xb), ops.gemm_gguf(xb, blocks, quant.Q8_0, None, path=cpu_ops.FAST))
