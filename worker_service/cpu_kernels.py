"""Which CPU kernels a bf16 model runs with, decided once at start from the CPU's flags.

The default is the fastest path on every CPU class:
- GEMMs: oneDNN over pre-packed weights, in bf16 where the CPU has bf16 instructions
  (AVX512-BF16 or AMX), else in float32 over the same (bf16-valued) weights, since torch
  emulates bf16 GEMMs dozens of times slower than float32 on AVX2-only CPUs;
- decode attention: the C++ paged kernel (GQA folded), whatever the GEMMs.

The flags are only a claim: before choosing native bf16 GEMMs a tiny packed bf16 GEMM is run
(`probe_bf16_gemm`), and where oneDNN refuses it (a wrong or faked flag read, a CPU it does not
support) the worker falls back to float32 GEMMs with the reason logged, rather than crashing.

`hf_exact_numerics` trades speed for HF's exact bf16 rounding: HF's own bf16 GEMMs
(F.linear, unpacked) and its decode attention call (no folding, no C++ kernel). The bf16 parity test turns it on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.config import ModelConfig

# Flags worth naming in logs and benchmark records, in this order.
NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as /proc/cpuinfo describes it."""

    model: str  # e.g. "Intel(R) Xeon(R) Processor"
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """True when the CPU has bf16 matmul instructions (AVX512-BF16 or AMX)."""
        return any(f in self.flags for f in BF16_FLAGS)

    def describe(self) -> str:
        """One line: model and the notable flags, e.g. for logs and benchmark JSON."""
        seen = [f for f in NOTABLE_FLAGS if f in self.flags] or ["no AVX2"]
        return f"{self.model} ({' '.join(seen)})"


def read_cpu_info(path: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """Model name and flags of the first CPU; unknown (no flags) where the file is missing."""
    try:
        text = path.read_text()
    except OSError:
        return CpuInfo("unknown CPU", frozenset())
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # first processor only
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return CpuInfo(
        fields.get("model name", "unknown CPU"), frozenset(fields.get("flags", "").split())
    )


@dataclass(frozen=True)
class KernelChoice:
    """How a bf16 model runs on this CPU, and why."""

    float32_gemms: bool  # bf16 GEMMs as float32 GEMMs over upcast weights
    hf_exact: bool  # HF's decode attention call (no GQA folding, no C++ kernel)
    reason: str

    def describe(self, cpu: CpuInfo) -> str:
        if self.hf_exact:
            gemm = "HF's bf16 GEMMs (F.linear)"
        elif self.float32_gemms:
            gemm = "oneDNN packed float32 GEMMs over bf16 weights"
        else:
            gemm = "oneDNN packed bf16 GEMMs"
        return f"CPU {cpu.describe()}: {gemm} ({self.reason})"


@functools.cache
def probe_bf16_gemm() -> str | None:
    """None when a oneDNN-packed bf16 GEMM runs on this CPU, else oneDNN's refusal."""
    import torch

    from worker_service.models.layers import linear_onednn, pack_onednn

    try:
        weight = pack_onednn(torch.ones(16, 16), torch.bfloat16)
        linear_onednn(torch.ones(2, 16, dtype=torch.bfloat16), weight)
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def choose_kernels(
    config: ModelConfig, cpu: CpuInfo, probe: Callable[[], str | None] | None = None
) -> KernelChoice:
    """The kernels for a bf16 model on `cpu` under `config` (bf16_gemm, hf_exact_numerics).

    Native bf16 GEMMs are chosen only once `probe` (default `probe_bf16_gemm`) saw one run;
    else float32 GEMMs, with the reason in the choice and the log."""
    if config.hf_exact_numerics:
        return KernelChoice(False, True, "hf_exact_numerics: HF's bf16 kernels, bit for bit")
    if config.bf16_gemm == "float32":
        return KernelChoice(True, False, "bf16_gemm=float32")
    if config.bf16_gemm == "native":
        wanted = "bf16_gemm=native"
    elif cpu.native_bf16:
        wanted = "auto: the CPU has bf16 instructions"
    else:
        return KernelChoice(True, False, "auto: no AVX512-BF16/AMX, bf16 GEMMs would be emulated")
    refusal = (probe or probe_bf16_gemm)()
    if refusal is None:
        return KernelChoice(False, False, wanted)
    reason = f"{wanted}, but oneDNN refused a bf16 GEMM ({refusal}); float32 GEMMs instead"
    log.warning("CPU kernels: %s", reason)
    return KernelChoice(True, False, reason)
