"""The weight-bound GEMMs (small_gemm.h: bf16 weights at a few rows; gguf_gemm.h: GGUF's
Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks and Q4_K / Q5_K / Q6_K super-blocks at any rows) against a float64 matmul of the same weight values
(the blocks dequantized as the gguf package does), on every build this CPU runs: the
portable loops, AVX2 and, where the CPU has them, AVX-512 and AVX512-BF16; and the Linear layers that choose
them (packed bf16, weight-only int8)."""

from __future__ import annotations

import gguf
import pytest
import torch

from worker_service import native
from worker_service.models import cpu_ops, quant
from worker_service.models.layers import Linear, deferred_weights

# GEMM shapes [N, K]: odd ones cover the tails of the vector loop (K) and of the chunks (N).
SHAPES = [(1, 7), (67, 33), (3072, 576), (576, 1536)]
ROWS = [*range(1, 9), 17, 40]  # 17, 40: blocks of 8 rows and a tail
LEVELS = {"AVX2": ["", "AVX2"], "AVX512": ["", "AVX2", "AVX512"]}  # what each CPU runs


def _runnable_levels() -> list[str]:
    levels = LEVELS.get(torch.backends.cpu.get_cpu_capability(), [""])
    if native.cpu_level() == "AVX512_BF16":  # bf16 pair dot products (gemm_bf16)
        levels = [*levels, "AVX512_BF16"]
    return levels


@pytest.fixture(scope="module", params=_runnable_levels(), ids=lambda v: v or "portable")
def ops(request: pytest.FixtureRequest) -> cpu_ops.CpuOps:
    return cpu_ops.build(request.param)


@pytest.mark.parametrize("level", ["", "AVX2", "AVX512", "AVX512_BF16"])
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


# Byte offsets of each format's half scales (d, dmin or m) in its block.
HALVES = {quant.Q4_0: [0], quant.Q4_1: [0, 2], quant.Q5_0: [0], quant.Q5_1: [0, 2],
          quant.Q8_0: [0], quant.Q4_K: [0, 2], quant.Q5_K: [0, 2], quant.Q6_K: [208]}  # fmt: skip
K_QUANTS = [t for t, size in quant.BLOCK_SIZE.items() if size == 256]


def random_blocks(ggml_type: int, n: int, k: int) -> torch.Tensor:
    """[n, k / size * bytes] uint8 of random values and scales (finite, small halves; the
    K-quants' 6- and 8-bit scales random too)."""
    size, nbytes = quant.BLOCK_SIZE[ggml_type], quant.BLOCK_BYTES[ggml_type]
    raw = torch.randint(0, 256, (n, k // size, nbytes), dtype=torch.uint8)
    for at in HALVES[ggml_type]:
        scales = (torch.rand(n, k // size, 1) * 0.02 - 0.005) / (size // quant.BLOCK)
        raw[..., at : at + 2] = scales.half().view(torch.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("ggml_type", list(quant.BLOCK_BYTES), ids=quant.TYPE_NAMES.get)
def test_dequantize_blocks_equals_the_gguf_package(ggml_type: int) -> None:
    blocks = random_blocks(ggml_type, 5, 96 if quant.BLOCK_SIZE[ggml_type] == 32 else 768)
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type))
    torch.testing.assert_close(
        quant.dequantize_blocks(blocks, ggml_type), torch.from_numpy(theirs), atol=0, rtol=0
    )


def _check_gemm_gguf(
    ops: cpu_ops.CpuOps, ggml_type: int, dtype: torch.dtype, rows: int, n: int, k: int
) -> None:
    torch.manual_seed(rows * n + k)
    blocks = random_blocks(ggml_type, n, k)
    x, b = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    w = quant.dequantize_blocks(blocks, ggml_type).double()
    exact = x.double() @ w.T
    magnitude = x.double().abs() @ w.abs().T
    ours = ops.gemm_gguf(x, blocks, ggml_type, b)
    assert ours.dtype == dtype
    _assert_float32_sums_rounded(ours, exact + b.double(), magnitude)
    _assert_float32_sums_rounded(ops.gemm_gguf(x, blocks, ggml_type, None), exact, magnitude)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (67, 96), (3072, 576), (576, 1536)])
@pytest.mark.parametrize(
    "ggml_type", [t for t in quant.BLOCK_BYTES if t not in K_QUANTS], ids=quant.TYPE_NAMES.get
)
def test_gemm_gguf_equals_dequantize_then_matmul(
    ops: cpu_ops.CpuOps, ggml_type: int, dtype: torch.dtype, rows: int, n: int, k: int
) -> None:
    _check_gemm_gguf(ops, ggml_type, dtype, rows, n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [*range(1, 9), 17, 33])
@pytest.mark.parametrize(("n", "k"), [(1, 256), (67, 512), (1029, 768), (576, 1536)])
@pytest.mark.parametrize("ggml_type", K_QUANTS, ids=quant.TYPE_NAMES.get)
def test_gemm_gguf_k_quants_equal_dequantize_then_matmul(
    ops: cpu_ops.CpuOps, ggml_type: int, dtype: torch.dtype, rows: int, n: int, k: int
) -> None:
    """Super-blocks of 256 weights: K any multiple of 256, odd column counts N."""
    _check_gemm_gguf(ops, ggml_type, dtype, rows, n, k)


def test_gemm_gguf_refuses_partial_blocks_and_unknown_types(ops: cpu_ops.CpuOps) -> None:
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="gemm_gguf: K=48 is not a whole number of blocks"):
        ops.gemm_gguf(x, torch.zeros(4, 34 + 17, dtype=torch.uint8), quant.Q8_0, None)
    for k_quant in K_QUANTS:  # 288 = 9 blocks of 32, not whole super-blocks of 256
        with pytest.raises(ValueError, match="K=288 is not a whole number of blocks"):
            ops.gemm_gguf(
                torch.randn(2, 288), torch.zeros(4, 144, dtype=torch.uint8), k_quant, None
            )
    with pytest.raises(ValueError, match="gemm_gguf"):
        ops.gemm_gguf(x[:, :32], torch.zeros(4, 34, dtype=torch.uint8), 10, None)  # Q2_K


@pytest.mark.parametrize("ggml_type", K_QUANTS, ids=quant.TYPE_NAMES.get)
def test_block_weight_refuses_partial_super_blocks(ggml_type: int) -> None:
    name = quant.TYPE_NAMES[ggml_type]
    with pytest.raises(ValueError, match=f"288 input features are not whole {name} blocks of 256"):
        quant.BlockWeight(torch.zeros(4, 2 * quant.BLOCK_BYTES[ggml_type], dtype=torch.uint8),
                          ggml_type, 288, None)  # fmt: skip


def test_q8_0_quantization_is_symmetric_per_block() -> None:
    w = torch.randn(4, 64) * torch.tensor([1e-3, 0.1, 1.0, 0.0])[:, None]
    q = quant.BlockWeight.quantize_q8_0(w, None)
    assert q.ggml_type == quant.Q8_0 and q.blocks.shape == (4, 68)
    values = q.blocks.reshape(4, 2, 34)[..., 2:].contiguous().view(torch.int8)
    assert (values[:3].abs().amax(dim=2) == 127).all() and (values[3] == 0).all()
    err = (q.dequantize(torch.float32) - w).abs().reshape(4, 2, 32).amax(dim=2)
    step = w.abs().reshape(4, 2, 32).amax(dim=2) / 127
    assert (err <= 0.5 * step * 1.01 + 1e-7).all()  # half a step (d rounded to a half)


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
    """A quantized Linear computes with its Q8_0 blocks, C++ or torch, and keeps no float copy;
    a tied weight (the LM head's) stays whole for the module it is shared with."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(80, 96)
    linear = Linear(96, 80, bias=False)
    linear.weight = embedding.weight  # tied, as LlamaForCausalLM ties its LM head
    linear.quantize()
    assert linear.quant is not None and linear.quant.ggml_type == quant.Q8_0
    assert linear.weight.numel() == 0
    assert embedding.weight.shape == (80, 96)
    if not with_ops:
        linear.quant.ops = None
    x = torch.randn(3, 96)
    expected = x @ linear.quant.dequantize(torch.float32).T
    torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)
    linear.pack(torch.float32)  # a quantized Linear is not packed again
    assert linear.packed is None


def test_deferred_weights_start_unallocated_until_blocks_replace_them() -> None:
    """The GGUF loader builds its model this way: no dense copy of a linear layer is made."""
    with deferred_weights():
        linear = Linear(64, 8, bias=False)
    assert linear.weight.is_meta and not Linear(64, 8).weight.is_meta
    linear.set_blocks(quant.BlockWeight.quantize_q8_0(torch.randn(8, 64), cpu_ops.load()))
    assert not linear.weight.is_meta and linear.weight.numel() == 0
    assert linear(torch.randn(2, 64)).shape == (2, 8)
