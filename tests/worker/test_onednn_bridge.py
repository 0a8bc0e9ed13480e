"""oneDNN's packed GEMM as a native callback (worker_service/models/onednn_bridge.py): the
fused decode step's GEMM past a few rows must be the layers' GEMM, to the bit."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from worker_service.cpu_kernels import probe_bf16_gemm
from worker_service.models import cpu_ops, onednn_bridge
from worker_service.models.layers import Linear
from worker_service.models.onednn_bridge import OnednnBridge

BF16_REFUSED = probe_bf16_gemm()  # None where oneDNN packs bf16 weights (AVX-512 BW/VL/DQ, AMX)
PACKED = torch.float32 if BF16_REFUSED else torch.bfloat16  # as the worker packs on this CPU


@pytest.fixture(scope="module")
def bridge() -> OnednnBridge:
    built = onednn_bridge.load()
    if built is None:
        pytest.skip("the oneDNN bridge cannot be built here (no torch headers or no oneDNN)")
    return built


@pytest.fixture(autouse=True)
def _no_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear.pack as on CPUs without AMX tiles: where the tiles run, they take every bf16
    weight of whole 32-value K blocks, and oneDNN packs only the others."""
    ops = cpu_ops.load()
    if ops is not None:
        monkeypatch.setattr(ops, "amx", False)


def _linear(k: int, n: int, bias: bool, compute: torch.dtype) -> Linear:
    torch.manual_seed(k * n)
    linear = Linear(k, n, bias=bias).to(torch.bfloat16)
    linear.pack(compute)
    return linear


def _call(bridge: OnednnBridge, handle: int, x: torch.Tensor, n: int) -> tuple[int, torch.Tensor]:
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype)
    gemm = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 3, ctypes.c_int64)(bridge.gemm)
    status = gemm(handle, x.data_ptr(), out.data_ptr(), x.shape[0])
    return status, out


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("k", "n", "bias"), [(576, 960, False), (64, 37, True), (96, 1, True)])
@pytest.mark.parametrize("rows", [1, 9, 33])
def test_the_callback_is_the_layers_gemm(
    bridge: OnednnBridge, compute: torch.dtype, k: int, n: int, bias: bool, rows: int
) -> None:
    """bf16 in and out; the weight packed in bf16, or in float32 as on AVX2 CPUs."""
    if compute == torch.bfloat16 and BF16_REFUSED:
        pytest.skip(f"oneDNN packs no bf16 weights on this CPU: {BF16_REFUSED}")
    linear = _linear(k, n, bias, compute)
    x = torch.randn(rows, k).to(torch.bfloat16)
    context = bridge.context(linear, torch.bfloat16)
    status, out = _call(bridge, context.handle, x, n)
    assert status == 0
    linear.small_gemm, linear.min_rows = None, 0  # the layers' oneDNN GEMM at every row count
    with torch.inference_mode():
        assert torch.equal(out, linear(x))


def test_the_context_holds_the_weight_after_the_linear_is_gone(bridge: OnednnBridge) -> None:
    linear = _linear(128, 64, True, PACKED)
    x = torch.randn(16, 128).to(torch.bfloat16)
    linear.small_gemm = None
    with torch.inference_mode():
        want = linear(x)
    context = bridge.context(linear, torch.bfloat16)
    del linear
    gc.collect()
    status, out = _call(bridge, context.handle, x, 64)
    assert status == 0 and torch.equal(out, want)


def test_a_failed_gemm_returns_a_status(bridge: OnednnBridge) -> None:
    """An exception inside the operator is a nonzero status, never a crash: here rows of 65
    values against a weight of 64 columns."""
    linear = _linear(64, 32, False, PACKED)
    assert linear.packed is not None
    handle = bridge.lib.tessera_onednn_context(linear.packed._cdata, 0, 65, 32, 1)
    try:
        status, _ = _call(bridge, handle, torch.randn(4, 65).to(torch.bfloat16), 32)
    finally:
        bridge.lib.tessera_onednn_release(handle)
    assert status == 1
