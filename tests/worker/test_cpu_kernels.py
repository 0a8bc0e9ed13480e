"""Kernel choice for bf16 on CPU: the fastest path by default on every CPU class (the C++
decode kernel stays on where the CPU has bf16 instructions), HF's exact kernels on request."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from services.config import ModelConfig, WorkerConfig
from tests.worker.test_qwen_models import _save_tiny
from worker_service import cpu_kernels, model_runner
from worker_service.cpu_kernels import CpuInfo, choose_kernels, probe_bf16_gemm, read_cpu_info
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
    choice = choose_kernels(ModelConfig(), cpu, probe=lambda: None)  # selection by flags alone
    assert not choice.hf_exact
    assert choice.float32_gemms == (not cpu.native_bf16)


def test_hf_exact_numerics_is_an_explicit_option() -> None:
    choice = choose_kernels(ModelConfig(hf_exact_numerics=True), AMX, probe=lambda: None)
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


@pytest.mark.parametrize("config", [ModelConfig(), ModelConfig(bf16_gemm="native")])
def test_a_refused_bf16_gemm_falls_back_to_float32(config: ModelConfig) -> None:
    """bf16 flags (faked, or misread) whose GEMM oneDNN refuses: float32 GEMMs, reason given."""
    choice = choose_kernels(config, AMX, probe=lambda: "bf16 path needs the cpu support")
    assert choice.float32_gemms and not choice.hf_exact
    assert "oneDNN refused a bf16 GEMM (bf16 path needs the cpu support)" in choice.reason


def test_the_probe_reports_what_this_cpu_runs() -> None:
    """The real probe on the real CPU: a bf16-capable CPU runs the packed bf16 GEMM."""
    refusal = probe_bf16_gemm()
    if read_cpu_info().native_bf16:
        assert refusal is None
    assert refusal is None or "bf16" in refusal


@pytest.mark.parametrize("cpu", [AVX512_BF16, AMX], ids=lambda c: c.model)
def test_bf16_capable_cpu_runs_native_gemms_and_the_decode_kernel(
    tiny_dir: Path, cpu: CpuInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faked bf16 flags: native bf16 GEMMs where this CPU really runs them, else the worker
    still starts, on float32 GEMMs (oneDNN refuses bf16 on an AVX2-only CPU)."""
    runner = _runner(tiny_dir, cpu, monkeypatch)
    runs_bf16 = probe_bf16_gemm() is None
    assert runner.backend.decode_kernel
    assert _gemm_dtypes(runner) == {torch.bfloat16 if runs_bf16 else torch.float32}
    assert runner.model.lm_head.weight.dtype == torch.bfloat16
    hidden = torch.ones(4, runner.model.config.hidden_size, dtype=torch.bfloat16)
    assert runner.model.compute_logits(hidden).shape == (4, runner.model.config.vocab_size)


def test_a_refused_probe_still_starts_the_worker(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "probe_bf16_gemm", lambda: "refused for the test")
    with caplog.at_level(logging.WARNING, logger="worker_service.cpu_kernels"):
        runner = _runner(tiny_dir, AMX, monkeypatch)
    assert _gemm_dtypes(runner) == {torch.float32}
    assert "oneDNN refused a bf16 GEMM (refused for the test)" in caplog.text


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
