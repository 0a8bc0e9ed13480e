"""The GGUF GEMM over bf16 panels (amx_gguf.h, the bf16 fast path from 6 rows on AMX CPUs,
from 8 (Q4_0 and Q4_1: 24) with AVX512-BF16 dot products on those without tiles,
gguf_dots.h): every block format, dequantized to bf16 a panel of 32 weight rows at a time,
against a float64 matmul of x with the same weights rounded to bf16. Row counts across the
16-row tiles and their pairs, the 8-row blocks of the dots' row pairs and the switch to their
Quads layout, column tails of the 32-row panels, bias. Runs only where the build has
AVX512-BF16 (the tile tests: where the CPU has AMX tiles); elsewhere each test skips and says
so."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_small_gemm import random_blocks
from worker_service import native
from worker_service.models import cpu_ops, quant

ROWS = [
    cpu_ops.BF16_GGUF_ROWS,  # both kernels' (the tiles' from AMX_GGUF_ROWS)
    9,
    15,
    16,
    17,
    cpu_ops.WIDE_GGUF_ROWS - 1,  # Q4_0 / Q4_1 without tiles: int8 x's last
    cpu_ops.WIDE_GGUF_ROWS,  # and their panels' first
    cpu_ops.QUAD_GGUF_ROWS - 1,  # the dots' last by row pairs
    cpu_ops.QUAD_GGUF_ROWS,  # and first in the Quads layout
    33,
    70,
]  # the fast path's smallest, x tiles of 16 and pairs of them
# Without tiles the panels take Q4_0 and Q4_1 from WIDE_GGUF_ROWS rows, others from BF16_GGUF_ROWS
WIDE_ROWS = dict.fromkeys([quant.Q4_0, quant.Q4_1], cpu_ops.WIDE_GGUF_ROWS)
SHAPES = {32: [(1, 32), (37, 96), (65, 576)], 256: [(33, 256), (70, 768)]}  # [N, K] by block


def _cases() -> list[tuple[int, int, int]]:
    return [
        (ggml_type, n, k)
        for ggml_type in quant.BLOCK_BYTES
        for n, k in SHAPES[quant.BLOCK_SIZE[ggml_type]]
    ]


@pytest.fixture(scope="module")
def panel_ops() -> cpu_ops.CpuOps:
    """The fused ops where FAST multiplies bf16 panels: an AVX512_BF16 build (tiles or not)."""
    ops = cpu_ops.load()
    if ops is None or native.cpu_level() != "AVX512_BF16":
        pytest.skip("needs a CPU with AVX512-BF16 (the bf16 panels' build)")
    return ops


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    ("ggml_type", "n", "k"), _cases(), ids=lambda v: quant.TYPE_NAMES.get(v, str(v))
)
def test_panels_multiply_the_weights_rounded_to_bf16(
    panel_ops: cpu_ops.CpuOps, ggml_type: int, rows: int, n: int, k: int
) -> None:
    torch.manual_seed(rows * n + k + ggml_type)
    blocks = random_blocks(ggml_type, n, k)
    x, b = torch.randn(rows, k).bfloat16(), torch.randn(n).bfloat16()
    w = quant.dequantize_blocks(blocks, ggml_type).bfloat16().double()
    ours = panel_ops.gemm_gguf(x, blocks, ggml_type, b, path=cpu_ops.FAST)
    if not panel_ops.amx and rows < WIDE_ROWS.get(ggml_type, cpu_ops.BF16_GGUF_ROWS):
        # Q4_0 / Q4_1 without tiles: int8 x up to here (test_gguf_q8.py checks its sums)
        assert torch.equal(ours, panel_ops.gemm_gguf(x, blocks, ggml_type, b, cpu_ops.INT8))
        return
    exact = x.double() @ w.T + b.double()
    magnitude = x.double().abs() @ w.abs().T + b.double().abs()
    # Output rounded once to bf16; float32 sums; a weight's bf16 rounding may differ by one
    # ulp from torch's where d q + m is one fused multiply-add in the kernel.
    bound = 2**-8 * exact.abs() + 2**-12 * magnitude
    assert ((ours.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize(
    ("many", "few"),
    [
        (cpu_ops.QUAD_GGUF_ROWS - 1, cpu_ops.BF16_GGUF_ROWS),  # tiles; dots by row pairs
        (70, cpu_ops.QUAD_GGUF_ROWS),  # tiles; dots in the Quads layout
    ],
)
def test_a_rows_result_does_not_depend_on_the_others(
    panel_ops: cpu_ops.CpuOps, many: int, few: int
) -> None:
    """Over the panels each row's sums run over K in one order whatever the batch, within
    each layout's row counts (the dots' two layouts sum in different orders)."""
    torch.manual_seed(0)
    blocks = random_blocks(quant.Q8_0, 960, 576)  # on the panels from BF16_GGUF_ROWS
    x = torch.randn(many, 576).bfloat16()
    batch = panel_ops.gemm_gguf(x, blocks, quant.Q8_0, None, path=cpu_ops.FAST)
    for i in (0, (many - few) // 2, many - few):
        alone = panel_ops.gemm_gguf(x[i : i + few], blocks, quant.Q8_0, None, path=cpu_ops.FAST)
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


def test_without_tiles_the_fast_path_takes_panels_from_bf16_gguf_rows(
    panel_ops: cpu_ops.CpuOps,
) -> None:
    """No tiles: below BF16_GGUF_ROWS rows the fast path is int8 x, from there the panels."""
    if panel_ops.amx:
        pytest.skip("this CPU lends AMX tiles: the fast path takes them")
    torch.manual_seed(1)
    blocks = random_blocks(quant.Q8_0, 64, 576)
    x = torch.randn(cpu_ops.BF16_GGUF_ROWS, 576).bfloat16()
    fast = panel_ops.gemm_gguf(x, blocks, quant.Q8_0, None, path=cpu_ops.FAST)
    assert not torch.equal(fast, panel_ops.gemm_gguf(x, blocks, quant.Q8_0, None, cpu_ops.INT8))
    fewer = panel_ops.gemm_gguf(x[:-1], blocks, quant.Q8_0, None, path=cpu_ops.FAST)
    assert torch.equal(
        fewer, panel_ops.gemm_gguf(x[:-1], blocks, quant.Q8_0, None, path=cpu_ops.INT8)
    )
