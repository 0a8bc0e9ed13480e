"""Weight-only quantization of a model's Linear layers at load (`--quantization int8`).

int8: per output channel, symmetric: w[n, :] ~= scale[n] * q[n, :] with q in [-127, 127]
and scale[n] = max |w[n, :]| / 127. Activations stay in the model dtype; the GEMM widens
the int8 weight in registers and sums in float32 (`cpu_ops.gemm_int8`), reading one byte
a weight where bf16 reads two and the float32 GEMMs of AVX2 four. Without the C++ ops
(no compiler, or not a CPU) the weight is dequantized per call: correct, not fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.models.cpu_ops import CpuOps

NATIVE = (torch.float32, torch.bfloat16)  # activation dtypes of the C++ GEMM


@dataclass
class Int8Weight:
    """A Linear's weight as int8 rows and their float32 scales."""

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32
    ops: CpuOps | None  # the C++ GEMM, where it runs

    @classmethod
    def quantize(cls, weight: torch.Tensor, ops: CpuOps | None) -> Int8Weight:
        """[out, in] float weight -> its per-row symmetric int8 form."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        return cls(q, scales.contiguous(), ops if weight.device.type == "cpu" else None)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in `dtype`: what the GEMM multiplies by."""
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[n, in] -> [n, out] in x's dtype."""
        if self.ops is not None and x.dim() == 2 and x.shape[0] > 0 and x.dtype in NATIVE:
            return self.ops.gemm_int8(x, self.qweight, self.scales, bias)
        return F.linear(x, self.dequantize(x.dtype), bias)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


def quantize_linears(model: nn.Module, method: str) -> int:
    """Quantize every Linear of `model` (`method`: ModelConfig.quantization); how many."""
    from worker_service.models.layers import Linear  # layers imports this module

    if method == "none":
        return 0
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.quant is None]
    for linear in linears:
        linear.quantize()
    return len(linears)
