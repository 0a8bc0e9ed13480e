"""The weight-bound GEMMs of small_gemm.h (bf16 weights at a few rows, int8 weights at any
rows) against a float64 matmul of the same weight values, on every build this CPU runs:
the portable loops, AVX2 and, where the CPU has it, AVX-512; and the Linear layers that
choose them (packed bf16, weight-only int8)."""

from __future__ import annotations

import pytest
import torch

from worker_service.models import cpu_ops
from worker_service.models.layers import Linear
from worker_service.models.quant import Int8Weight

# GEMM shapes [N, K]: odd ones cover the tails of the vector loop (K) and of the chunks (N).
SHAPES = [(1, 7), (67, 33), (3072, 576), (576, 1536)]
ROWS = [*range(1, 9), 17, 40]  # 17, 40: blocks of 8 rows and a tail
LEVELS = {"AVX2": ["", "AVX2"], "AVX512": ["", "AVX2", "AVX512"]}  # what each CPU runs


def _runnable_levels() -> list[str]:
    return LEVELS.get(torch.backends.cpu.get_cpu_capability(), [""])


@pytest.fixture(scope="module", params=_runnable_levels(), ids=lambda v: v or "portable")
def ops(request: pytest.FixtureRequest) -> cpu_ops.CpuOps:
    return cpu_ops.build(request.param)


@pytest.mark.parametrize("level", ["", "AVX2", "AVX512"])
def test_every_level_builds(level: str) -> None:
    """Each variant compiles (and loads) here, including those this CPU cannot run."""
    assert cpu_ops.build(level).lib is not None


def _assert_float32_sums_rounded(
    ours: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor
) -> None:
    """ours = the float32 sum (any order) of the k products of `exact` (float64), rounded
    once to ours' dtype: within half an ulp of exact plus float32 summation error."""
    k = 2048  # at most this many products per sum here
    ulp = 2**-8 if ours.dtype == torch.bfloat16 else 2**-23
    bound = ulp * exact.abs() + k * 2**-24 * magnitude
    assert ((ours.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemm_bf16(ops: cpu_ops.CpuOps, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * n + k)
    x, w, b = (torch.randn(*shape).bfloat16() for shape in ((rows, k), (n, k), (n,)))
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    _assert_float32_sums_rounded(ops.gemm_bf16(x, w, b), exact + b.double(), magnitude)
    _assert_float32_sums_rounded(ops.gemm_bf16(x, w, None), exact, magnitude)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemm_int8_equals_dequantize_then_matmul(
    ops: cpu_ops.CpuOps, dtype: torch.dtype, rows: int, n: int, k: int
) -> None:
    torch.manual_seed(rows * n + k)
    weight = Int8Weight.quantize(torch.randn(n, k), ops)
    x, b = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    w = weight.dequantize(torch.float64)
    exact = x.double() @ w.T
    magnitude = x.double().abs() @ w.abs().T
    ours = ops.gemm_int8(x, weight.qweight, weight.scales, b)
    assert ours.dtype == dtype
    _assert_float32_sums_rounded(ours, exact + b.double(), magnitude)
    _assert_float32_sums_rounded(
        ops.gemm_int8(x, weight.qweight, weight.scales, None), exact, magnitude
    )


def test_int8_quantization_is_per_row_symmetric() -> None:
    w = torch.randn(5, 64) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 0.0])[:, None]
    q = Int8Weight.quantize(w, None)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    assert (q.qweight[:4].abs().amax(dim=1) == 127).all() and (q.qweight[4] == 0).all()
    rel = (q.dequantize(torch.float32) - w).abs().amax(dim=1)[:4] / w[:4].abs().amax(dim=1)
    assert (rel <= 0.5 / 127 + 1e-6).all()  # at most half a step of each row's scale


@pytest.mark.parametrize("rows", [1, 5, cpu_ops.SMALL_GEMM_ROWS, 9, 40])
def test_upcast_linear_takes_the_few_row_gemm_up_to_its_rows(rows: int) -> None:
    """A bf16 Linear packed to float32 (AVX2's choice) gives one result whichever GEMM its
    row count picks: the few-row bf16 GEMM or oneDNN's float32 one."""
    torch.manual_seed(rows)
    linear = Linear(96, 80, bias=True).bfloat16()
    x = torch.randn(rows, 96).bfloat16()
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    magnitude = x.double().abs() @ linear.weight.double().abs().T
    linear.pack(torch.float32)
    assert (linear.small_gemm is not None) == (cpu_ops.load() is not None)
    _assert_float32_sums_rounded(linear(x), exact, magnitude)


@pytest.mark.parametrize("with_ops", [True, False])
def test_int8_linear_drops_its_float_weight(with_ops: bool) -> None:
    """A quantized Linear computes with the int8 copy, C++ or torch, and keeps no float one;
    a tied weight (the LM head's) stays whole for the module it is shared with."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(80, 96)
    linear = Linear(96, 80, bias=False)
    linear.weight = embedding.weight  # tied, as LlamaForCausalLM ties its LM head
    linear.quantize()
    assert linear.quant is not None and linear.weight.numel() == 0
    assert embedding.weight.shape == (80, 96)
    if not with_ops:
        linear.quant.ops = None
    x = torch.randn(3, 96)
    expected = x @ linear.quant.dequantize(torch.float32).T
    torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)
    linear.pack(torch.float32)  # a quantized Linear is not packed again
    assert linear.packed is None
