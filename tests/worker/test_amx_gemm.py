"""The AMX bf16 GEMM (amx_gemm.h) against a float64 matmul of the same values: its tile
layout (cpu_ops.pack_amx), row counts across the 16-row tiles and 32-row passes, column tails,
bias, and the Linear layers that choose it. Runs only where the CPU has AMX tiles for bf16;
elsewhere each test skips and says so (the AVX512_BF16 build that holds it is compiled on
every machine by test_small_gemm.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.worker.test_small_gemm import _assert_float32_sums_rounded
from worker_service import native
from worker_service.models import cpu_ops
from worker_service.models.layers import GatedMLP, Linear

SHAPES = [(1, 32), (17, 64), (33, 96), (960, 576), (576, 1536)]  # [N, K]: N tails, K in 32s
PROBE = Path(__file__).with_name("native") / "tile_config_probe.cpp"
# Tiles of 16 rows, passes of 32, blocks of 128 (kRowBlock).
ROWS = [1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 70, 130, 300]


def test_pack_amx_puts_pairs_of_k_in_tiles_of_16_columns() -> None:
    w = torch.arange(33 * 64, dtype=torch.float32).reshape(33, 64).bfloat16()
    packed = cpu_ops.pack_amx(w)
    assert packed.shape == (3, 2, 16, 16, 2)
    for j, kb, r, c, e in [(0, 0, 0, 0, 0), (1, 1, 5, 7, 1), (2, 0, 15, 0, 1), (0, 1, 3, 15, 0)]:
        assert packed[j, kb, r, c, e] == w[16 * j + c, 32 * kb + 2 * r + e]
    assert (packed[2, :, :, 1:] == 0).all()  # columns past N are zero


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemm_amx(amx_ops: cpu_ops.CpuOps, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * n + k)
    x, w, b = (torch.randn(*shape).bfloat16() for shape in ((rows, k), (n, k), (n,)))
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    packed = cpu_ops.pack_amx(w)
    _assert_float32_sums_rounded(amx_ops.gemm_amx(x, packed, b, n), exact + b.double(), magnitude)
    _assert_float32_sums_rounded(amx_ops.gemm_amx(x, packed, None, n), exact, magnitude)


def test_a_rows_result_does_not_depend_on_the_others(amx_ops: cpu_ops.CpuOps) -> None:
    """Each row's sums run over K in one order whatever the batch: alone = in 70 rows."""
    torch.manual_seed(0)
    x, w = torch.randn(70, 576).bfloat16(), torch.randn(960, 576).bfloat16()
    packed = cpu_ops.pack_amx(w)
    batch = amx_ops.gemm_amx(x, packed, None, 960)
    for i in (0, 17, 69):
        assert torch.equal(amx_ops.gemm_amx(x[i : i + 1], packed, None, 960)[0], batch[i])


def test_gemm_amx_refuses_k_not_in_32s(amx_ops: cpu_ops.CpuOps) -> None:
    x, packed = torch.zeros(2, 48).bfloat16(), torch.zeros(1, 2, 16, 16, 2).bfloat16()
    with pytest.raises(ValueError, match="gemm_amx"):
        amx_ops.gemm_amx(x, packed, None, 16)


def count_rows(monkeypatch: pytest.MonkeyPatch, op: str) -> list[int]:
    """The row counts of x the CpuOps method `op` is called with, from now on."""
    calls: list[int] = []
    method = getattr(cpu_ops.CpuOps, op)

    def counted(self: cpu_ops.CpuOps, x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return method(self, x, *args)

    monkeypatch.setattr(cpu_ops.CpuOps, op, counted)
    return calls


ONEDNN_FROM = cpu_ops.AMX_ONEDNN_ROWS


@pytest.mark.parametrize("rows", [1, 64, 65, 300, ONEDNN_FROM - 1, ONEDNN_FROM, 2 * ONEDNN_FROM])
def test_bf16_linear_takes_amx_below_the_onednn_rows(
    amx_ops: cpu_ops.CpuOps, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """gemm_amx up to AMX_ONEDNN_ROWS - 1 rows; from there oneDNN over the plain weight."""
    calls = count_rows(monkeypatch, "gemm_amx")
    torch.manual_seed(rows)
    layer = Linear(576, 200).bfloat16()
    layer.pack(torch.bfloat16)
    assert layer.amx is not None
    x = torch.randn(rows, 576).bfloat16()
    ours, reference = layer(x), F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert calls == ([rows] if rows < ONEDNN_FROM else [])
    assert layer.packed is None  # no oneDNN-packed copy beside the tiles' one
    torch.testing.assert_close(ours.float(), reference, rtol=2e-2, atol=2e-2)


def test_a_linear_whose_k_is_not_in_32s_keeps_the_other_gemms(amx_ops: cpu_ops.CpuOps) -> None:
    layer = Linear(48, 16).bfloat16()
    layer.pack(torch.bfloat16)
    assert layer.amx is None
    x = torch.randn(3, 48).bfloat16()
    torch.testing.assert_close(layer(x).float(), F.linear(x, layer.weight, layer.bias).float())


@pytest.mark.parametrize("rows", [70, ONEDNN_FROM])
def test_a_float32_input_runs_in_bf16_as_the_packed_path_did(
    amx_ops: cpu_ops.CpuOps, rows: int
) -> None:
    layer = Linear(576, 64).bfloat16()
    layer.pack(torch.bfloat16)
    x = torch.randn(rows, 576)
    ours = layer(x)
    assert ours.dtype == torch.float32
    reference = F.linear(x.bfloat16().float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(ours, reference, rtol=2e-2, atol=2e-2)


def test_tile_configuration_survives_an_out_of_line_call(tmp_path: Path) -> None:
    """amx_gemm's configuration, built in a function that is not inlined into the tiles' user,
    still configures them (GCC 12's _tile_loadconfig reads 8 bytes as far as the optimizer
    knows, and dropped the rows and columns: the tiles then faulted with SIGILL). Run in a
    child process, so that a fault fails this test and not the session."""
    if not native.amx_bf16_cpu():
        pytest.skip("needs a CPU with AMX tiles for bf16 (amx_tile, amx_bf16)")
    library = tmp_path / "probe.so"
    native._compile(PROBE, library, native.compile_flags("AVX512_BF16"))
    script = f"import ctypes; print(ctypes.CDLL({str(library)!r}).tessera_probe_tiles())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, f"the probe died ({done.returncode}): {done.stderr}"
    assert done.stdout.strip() == "1"


@pytest.mark.parametrize("rows", [1, 17, 33, 130])
@pytest.mark.parametrize(("inter", "k"), [(16, 32), (48, 96), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_gemm_is_gemm_then_silu_mul(
    amx_ops: cpu_ops.CpuOps, rows: int, inter: int, k: int, bias: bool
) -> None:
    """The gated MLP's fused epilogue gives the bits of the two steps it replaces."""
    torch.manual_seed(rows + inter + k)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(2 * inter, k).bfloat16()
    b = torch.randn(2 * inter).bfloat16() if bias else None
    packed = cpu_ops.pack_amx(w)
    two_steps = amx_ops.silu_mul(amx_ops.gemm_amx(x, packed, b, 2 * inter))
    assert torch.equal(amx_ops.gemm_amx_gated(x, packed, b, inter), two_steps)


def packed_mlp(ops: cpu_ops.CpuOps, seed: int) -> GatedMLP:
    """A bf16 GatedMLP(64, 48) of random weights, packed for the tiles, with the CPU ops."""
    torch.manual_seed(seed)
    mlp = GatedMLP(64, 48).bfloat16()
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.pack(torch.bfloat16)
    mlp.ops = ops
    return mlp


def test_the_gated_mlp_takes_the_fused_epilogue(
    amx_ops: cpu_ops.CpuOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GatedMLP with the CPU ops runs one gated GEMM, not gate_up then silu_mul, and gives what
    the two steps give."""
    calls = count_rows(monkeypatch, "gemm_amx_gated")
    mlp = packed_mlp(amx_ops, seed=0)
    x = torch.randn(40, 64).bfloat16()
    ours = mlp(x)
    assert calls == [40]
    two_steps = mlp.down_proj(amx_ops.silu_mul(mlp.gate_up_proj(x)))
    assert torch.equal(ours, two_steps)


def test_a_prefill_sized_gated_mlp_runs_onednn_then_silu_mul(
    amx_ops: cpu_ops.CpuOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From AMX_ONEDNN_ROWS rows the gate_up GEMM is oneDNN's (no fused epilogue), then
    silu_mul: the same bits as the two steps."""
    calls = count_rows(monkeypatch, "gemm_amx_gated")
    mlp = packed_mlp(amx_ops, seed=1)
    x = torch.randn(ONEDNN_FROM, 64).bfloat16()
    ours = mlp(x)
    assert calls == []
    gate_up = F.linear(x, mlp.gate_up_proj.weight)
    assert torch.equal(ours, mlp.down_proj(amx_ops.silu_mul(gate_up)))
