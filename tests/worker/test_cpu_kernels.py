"""Kernel choice for bf16 on CPU: the fastest path by default on every CPU class (the C++
decode kernel stays on where the CPU has bf16 instructions), HF's exact kernels on request."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.config import ModelConfig, WorkerConfig
from tests.worker.test_qwen_models import _save_tiny
from worker_service import model_runner
from worker_service.cpu_kernels import CpuInfo, choose_kernels, read_cpu_info
from worker_service.models.layers import Linear
from worker_service.worker import Worker

AVX2 = CpuInfo("AMD EPYC (fake)", frozenset({"avx", "avx2", "fma"}))
AVX512 = CpuInfo("Intel Xeon (fake)", frozenset({"avx2", "avx512f"}))
AVX512_BF16 = CpuInfo("AMD EPYC Genoa (fake)", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = CpuInfo("Intel Xeon SPR (fake)", frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"}))


def test_read_cpu_info_takes_the_first_processor(tmp_path: Path) -> None:
    text = (
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n"
    )
    (tmp_path / "cpuinfo").write_text(text)
    info = read_cpu_info(tmp_path / "cpuinfo")
    assert info.model == "Some CPU" and info.native_bf16
    assert info.describe() == "Some CPU (avx2 avx512_bf16)"
    assert read_cpu_info(tmp_path / "missing") == CpuInfo("unknown CPU", frozenset())


@pytest.mark.parametrize("cpu", [AVX2, AVX512, AVX512_BF16, AMX], ids=lambda c: c.model)
def test_default_keeps_the_decode_kernel_on_every_cpu_class(cpu: CpuInfo) -> None:
    choice = choose_kernels(ModelConfig(), cpu)
    assert not choice.hf_exact
    assert choice.float32_gemms == (not cpu.native_bf16)


def test_hf_exact_numerics_is_an_explicit_option() -> None:
    choice = choose_kernels(ModelConfig(hf_exact_numerics=True), AMX)
    assert choice.hf_exact and not choice.float32_gemms
    with pytest.raises(ValueError, match="hf_exact_numerics"):
        ModelConfig(hf_exact_numerics=True, bf16_gemm="float32")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("qwen2", tmp_path_factory.mktemp("qwen2-kernels"))


def _runner(tiny_dir: Path, cpu: CpuInfo, monkeypatch: pytest.MonkeyPatch, **opts: object):
    monkeypatch.setattr(model_runner, "read_cpu_info", lambda: cpu)
    config = ModelConfig(model=str(tiny_dir), dtype="bfloat16", **opts)  # type: ignore[arg-type]
    return Worker(WorkerConfig(model=config, attention_backend="cpu")).runner


def _gemm_dtypes(runner: model_runner.ModelRunner) -> set[torch.dtype | None]:
    return {m.compute_dtype for m in runner.model.modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("cpu", [AVX512_BF16, AMX], ids=lambda c: c.model)
def test_bf16_capable_cpu_runs_native_gemms_and_the_decode_kernel(
    tiny_dir: Path, cpu: CpuInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(tiny_dir, cpu, monkeypatch)
    assert runner.backend.decode_kernel
    assert _gemm_dtypes(runner) == {torch.bfloat16}
    assert runner.model.lm_head.weight.dtype == torch.bfloat16


def test_avx2_cpu_runs_float32_gemms_and_the_decode_kernel(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(tiny_dir, AVX2, monkeypatch)
    assert runner.backend.decode_kernel
    assert _gemm_dtypes(runner) == {torch.float32}


def test_hf_exact_turns_the_decode_kernel_off(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(tiny_dir, AMX, monkeypatch, hf_exact_numerics=True)
    assert not runner.backend.decode_kernel
    assert _gemm_dtypes(runner) == {None}  # HF's own F.linear


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_packing_bounds_onednn_primitive_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN keeps one GEMM primitive per batch size in two caches; packing caps both (read
    at the first primitive) unless the user chose a capacity."""
    from worker_service.models.layers import ONEDNN_CACHE_CAPACITY, pack_onednn

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    pack_onednn(torch.randn(8, 8), torch.float32)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == ONEDNN_CACHE_CAPACITY
    assert os.environ["LRU_CACHE_CAPACITY"] == "64"
