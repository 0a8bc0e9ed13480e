"""The GGUF GEMM on AMX tiles (amx_gguf.h, the bf16 fast path from 6 rows on AMX CPUs): every
block format, dequantized to bf16 a panel of 32 weight rows at a time, against a float64
matmul of x with the same weights rounded to bf16. Row counts across the 16-row tiles and
their pairs, column tails of the 32-row panels, bias. Runs only where the CPU has AMX tiles
for bf16; elsewhere each test skips and says so."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_small_gemm import random_blocks
from worker_service.models import cpu_ops, quant

ROWS = [
    cpu_ops.AMX_GGUF_ROWS,
    15,
    16,
    17,
    32,
    33,
    70,
]  # the fast path's smallest, x tiles of 16 and pairs of them
SHAPES = {32: [(1, 32), (37, 96), (65, 576)], 256: [(33, 256), (70, 768)]}  # [N, K] by block


def _cases() -> list[tuple[int, int, int]]:
    return [
        (ggml_type, n, k)
        for ggml_type in quant.BLOCK_BYTES
        for n, k in SHAPES[quant.BLOCK_SIZE[ggml_type]]
    ]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    ("ggml_type", "n", "k"), _cases(), ids=lambda v: quant.TYPE_NAMES.get(v, str(v))
)
def test_tiles_multiply_the_weights_rounded_to_bf16(
    amx_ops: cpu_ops.CpuOps, ggml_type: int, rows: int, n: int, k: int
) -> None:
    torch.manual_seed(rows * n + k + ggml_type)
    blocks = random_blocks(ggml_type, n, k)
    x, b = torch.randn(rows, k).bfloat16(), torch.randn(n).bfloat16()
    w = quant.dequantize_blocks(blocks, ggml_type).bfloat16().double()
    ours = amx_ops.gemm_gguf(x, blocks, ggml_type, b, path=cpu_ops.FAST)
    exact = x.double() @ w.T + b.double()
    magnitude = x.double().abs() @ w.abs().T + b.double().abs()
    # Output rounded once to bf16; float32 sums; a weight's bf16 rounding may differ by one
    # ulp from torch's where d q + m is one fused multiply-add in the kernel.
    bound = 2**-8 * exact.abs() + 2**-12 * magnitude
    assert ((ours.double() - exact).abs() <= bound).all()


def test_a_rows_result_does_not_depend_on_the_others(amx_ops: cpu_ops.CpuOps) -> None:
    """On the tiles each row's sums run over K in one order whatever the batch."""
    torch.manual_seed(0)
    blocks = random_blocks(quant.Q4_1, 960, 576)
    x = torch.randn(70, 576).bfloat16()
    batch = amx_ops.gemm_gguf(x, blocks, quant.Q4_1, None, path=cpu_ops.FAST)
    few = cpu_ops.AMX_GGUF_ROWS
    for i in (0, 17, 70 - few):
        alone = amx_ops.gemm_gguf(x[i : i + few], blocks, quant.Q4_1, None, path=cpu_ops.FAST)
        assert torch.equal(alone, batch[i : i + few])


def test_the_fast_path_takes_the_tiles_from_amx_gguf_rows(amx_ops: cpu_ops.CpuOps) -> None:
    """Below AMX_GGUF_ROWS rows the fast path is int8 x (gguf_q8.h), from there the tiles,
    whose result differs from int8 x's."""
    torch.manual_seed(1)
    blocks = random_blocks(quant.Q8_0, 64, 576)
    x = torch.randn(cpu_ops.AMX_GGUF_ROWS, 576).bfloat16()
    fast = amx_ops.gemm_gguf(x, blocks, quant.Q8_0, None, path=cpu_ops.FAST)
    int8 = amx_ops.gemm_gguf(x, blocks, quant.Q8_0, None, path=cpu_ops.INT8)
    assert not torch.equal(fast, int8)
    fewer = amx_ops.gemm_gguf(x[:-1], blocks, quant.Q8_0, None, path=cpu_ops.FAST)
    assert torch.equal(
        fewer, amx_ops.gemm_gguf(x[:-1], blocks, quant.Q8_0, None, path=cpu_ops.INT8)
    )
