"""The Triton dequant GEMM (worker_service/models/quant_triton.py) against dequantize-then-
matmul in float32, on CPU through the Triton interpreter. Triton picks compiling or
interpreting when the kernel is decorated, so the cases run in a child pytest started with
TRITON_INTERPRET=1 (tests/worker/interpret.py), as the attention and MoE kernel tests do.

The cases, random blocks and references live in benchmarks/quant_cases.py (shared with
benchmarks/gpu_check_quant.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from benchmarks.quant_cases import (
    BF16,
    CASES,
    F16,
    F32,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
    Q8_0,
    TOLERANCE,
    random_blocks,
    reference_weight,
)
from tests.worker.interpret import run_under_interpreter

CHILD_FLAG = "TESSERA_QUANT_TRITON_CHILD"
IN_CHILD = os.environ.get(CHILD_FLAG) == "1"
DTYPES = [F32, F16, BF16]
NUM_CHILD_TESTS = len(CASES) * len(DTYPES) + 5


def check(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == ref.shape
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]:.0e}"


if IN_CHILD:
    from worker_service.models import quant_triton
    from worker_service.models.quant import BlockWeight

    def test_running_interpreted() -> None:
        assert quant_triton.interpreted()

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("ggml_type,m,n,k", CASES)
    def test_dequant_gemm_matches_dequantize_then_matmul(
        ggml_type: int, m: int, n: int, k: int, dtype: torch.dtype
    ) -> None:
        gen = torch.Generator().manual_seed(ggml_type * 1000 + m * 31 + n)
        blocks = random_blocks(n, k, ggml_type, gen)
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if m % 2 else None
        got = quant_triton.dequant_gemm(x, blocks, ggml_type, bias)
        ref = x.float() @ reference_weight(blocks, ggml_type).T
        check(got, ref if bias is None else ref + bias.float(), dtype)

    def test_block_linear_keeps_leading_dims_and_matches_block_weight() -> None:
        gen = torch.Generator().manual_seed(7)
        weight = BlockWeight.quantize_q8_0(torch.randn(21, 64, generator=gen), None)
        x = torch.randn(2, 3, 64, generator=gen)
        got = quant_triton.block_linear(x, weight.blocks, Q8_0, None)
        assert got.shape == (2, 3, 21)
        check(got, x @ weight.dequantize(F32).T, F32)

    def test_empty_rows_and_bad_blocks() -> None:
        blocks = random_blocks(5, 64, Q4_0, torch.Generator().manual_seed(1))
        assert quant_triton.dequant_gemm(torch.zeros(0, 64), blocks, Q4_0).shape == (0, 5)
        with pytest.raises(ValueError, match="do not hold 96 inputs"):
            quant_triton.dequant_gemm(torch.zeros(1, 96), blocks, Q4_0)
        with pytest.raises(ValueError, match="no Triton dequant GEMM"):
            quant_triton.dequant_gemm(torch.zeros(1, 64), blocks, 6)

    def test_tile_sizes_pick_the_dot_path_from_16_rows() -> None:
        assert quant_triton.tile_sizes(1) == (1, 32)
        assert quant_triton.tile_sizes(3) == (4, 32)
        assert quant_triton.tile_sizes(16)[0] == 16
        assert quant_triton.tile_sizes(33)[0] == 64

    def test_gpu_check_cases_run_on_cpu() -> None:
        """benchmarks/gpu_check_quant.py's CPU-side code: a case through BlockWeight (the
        CPU path here) and one through the kernel; timings with a one-call timer."""
        from benchmarks import gpu_check_quant as check

        assert check.check_quant_case(Q4_1, 3, 37, 64, F32, "cpu")["ok"]
        assert check.check_quant_case(Q6_K, 17, 7, 256, BF16, "cpu")["ok"]

        def one_call(fn: Callable[[], object]) -> float:
            fn()
            return 2.0

        rows = check.quant_timings(one_call, [(9, 256)], "cpu")
        assert [r["format"] for r in rows] == ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"] * 2
        assert rows[0] == {
            "shape": "M1 N9 K256", "format": "Q4_0", "dequant_gemm_ms": 2.0,
            "torch_bf16_ms": 2.0, "bf16_over_dequant": 1.0,
        }  # fmt: skip

else:

    def test_gpu_check_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
        """gpu_check (which holds the dequant section) imports, and exits 2 on CPU."""
        pytest.importorskip("triton")
        from benchmarks import gpu_check

        monkeypatch.setattr("sys.argv", ["gpu_check", "--only-dequant"])
        assert gpu_check.main() == 2

    @pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0, Q4_K, Q6_K])
    def test_kernel_compiles_for_hopper(ggml_type: int) -> None:
        """The interpreter runs what compiled Triton may refuse: compile every format for
        sm_90 (to a cubin, no GPU needed) on the launcher's own constexprs: the decode
        (no-dot) and tl.dot variants in bf16, and (Q4_1) the float32 ieee dot."""
        pytest.importorskip("triton")
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from worker_service.models import quant_triton

        variants = [(BF16, 1), (BF16, 64)] + ([(F32, 32)] if ggml_type == Q4_1 else [])
        for dtype, m in variants:
            ptr = {BF16: "*bf16", F32: "*fp32"}[dtype]
            signature = {
                "x_ptr": ptr, "blocks_ptr": "*u8", "halves_ptr": "*fp16", "bias_ptr": ptr,
                "out_ptr": ptr, **dict.fromkeys(("M", "N", "K", "row_bytes"), "i32"),
                "stride_xm": "i32", "stride_om": "i32",
            }  # fmt: skip
            consts = {"HAS_BIAS": True, **quant_triton.kernel_constants(dtype, ggml_type, m)}
            kernel = quant_triton._dequant_gemm_kernel
            names = kernel.arg_names  # the signature in the kernel's parameter order
            types = {**signature, **dict.fromkeys(consts, "constexpr")}
            source = ASTSource(
                fn=kernel,
                signature={name: types[name] for name in names},
                constexprs={(names.index(k),): v for k, v in consts.items()},
            )
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"], (dtype, m)

    def test_kernel_under_interpreter() -> None:
        """Runs this file's kernel cases in a child pytest with TRITON_INTERPRET=1."""
        pytest.importorskip("triton")
        run_under_interpreter(__file__, CHILD_FLAG, NUM_CHILD_TESTS)
