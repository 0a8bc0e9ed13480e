"""4-bit weights in GGUF's Q4_0 / Q4_1 blocks: `--quantization int4` at load, and the repacking
of AWQ / GPTQ checkpoints (worker_service/prequantized.py), so the C++ GEMM runs them as is.

int4 is asymmetric and group-wise (`--quantization-group-size` 32, 64 or 128): a group of
consecutive weights of a row shares a half scale d and a half offset m, w = d * q + m with
q in 0..15, d = (max - min) / 15, m = min, q = round((w - m) / d) over the rounded d and m
(ggml's Q4_1, which is group 32). A group of 64 or 128 is 2 or 4 consecutive Q4_1 blocks
carrying the same d and m: same bytes and kernel, coarser statistics. Where the row length
is not a whole number of groups, its last group is shorter (a whole number of 32-blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.models import cpu_ops
from worker_service.models.cpu_ops import CpuOps
from worker_service.models.quant import (
    BLOCK,
    Q4_0,
    Q4_1,
    BlockWeight,
    dequantize_blocks,
    quantize_linears,
)


def pack_q4(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, ops: CpuOps | None
) -> BlockWeight:
    """q [out, in] integers 0..15, d and m [out, in / 32] half -> Q4_1 blocks (w = d * q + m),
    or Q4_0 (w = d * (q - 8)) where m is None."""
    out, blocks = d.shape
    q = q.to(torch.uint8).reshape(out, blocks, BLOCK)
    qs = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # [out, blocks, 16]: j and j + 16
    scales = [d.half().contiguous().view(torch.uint8).reshape(out, blocks, 2)]
    if m is not None:
        scales.append(m.half().contiguous().view(torch.uint8).reshape(out, blocks, 2))
    raw = torch.cat([*scales, qs], dim=2)  # [out, blocks, 18 or 20]
    return BlockWeight(raw.reshape(out, -1), Q4_1 if m is not None else Q4_0, blocks * BLOCK, ops)


@dataclass
class ExactOffsetQ4_1(BlockWeight):
    """Q4_1 blocks whose offsets m = -z * s (AWQ / GPTQ) are not all halves: the rounding
    they lose is added back per call, so the weight is exactly (q - z) * s (in float32).

    y = x W_q4_1^T + (per-group sums of x) R^T, R = m - half(m): one [n, groups] x
    [groups, out] product, 4 bytes per group of a row (+5% of Q4_1's bytes at group 128)."""

    residual: torch.Tensor  # [out, groups] float32: each group's exact m minus its half
    block_group: torch.Tensor  # [in / 32] int64: the group of each 32-block of a row

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in `dtype`: the values the GEMM and its correction multiply by."""
        w = dequantize_blocks(self.blocks, self.ggml_type).reshape(self.blocks.shape[0], -1, BLOCK)
        return (w + self.residual[:, self.block_group, None]).reshape(w.shape[0], -1).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[n, in] -> [n, out] in x's dtype."""
        y = super().linear(x, bias)
        sums = x.float().reshape(*x.shape[:-1], -1, BLOCK).sum(-1)  # [n, in / 32]
        groups = sums.new_zeros(*x.shape[:-1], self.residual.shape[1])  # [n, groups]
        groups.index_add_(-1, self.block_group.to(x.device), sums)
        return (y.float() + groups @ self.residual.T).to(y.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.residual.nbytes


def block_groups(in_features: int, group: int) -> torch.Tensor:
    """[in / 32] the group of each 32-block of a row (groups of `group` weights, -1: one)."""
    starts = torch.arange(in_features // BLOCK) * BLOCK
    return torch.zeros_like(starts) if group < 0 else starts // group


def quantize_q4_1(weight: torch.Tensor, group: int, ops: CpuOps | None) -> BlockWeight:
    """[out, in] float weight -> Q4_1 blocks, one (d, m) per `group` weights of a row."""
    w = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)  # [out, blocks, 32]
    groups = block_groups(weight.shape[1], group).expand(w.shape[0], -1)  # [out, blocks]
    count = int(groups[0, -1]) + 1
    lo = w.new_full((w.shape[0], count), float("inf"))
    lo = lo.scatter_reduce(1, groups, w.amin(dim=2), "amin")[:, groups[0]]  # [out, blocks]
    hi = w.new_full((w.shape[0], count), float("-inf"))
    hi = hi.scatter_reduce(1, groups, w.amax(dim=2), "amax")[:, groups[0]]
    d, m = ((hi - lo) / 15).half(), lo.half()
    safe = torch.where(d == 0, torch.ones_like(d), d).float()
    q = torch.round((w - m.float()[..., None]) / safe[..., None]).clamp_(0, 15)
    return pack_q4(q.reshape(weight.shape), d, m, ops)


def quantize_at_load(model: torch.nn.Module, method: str, group: int) -> str:
    """`--quantization int8 / int4`: quantize every Linear of `model` whose rows are whole
    32-blocks (int4: the output head to 8 bits); what was done, for the log ("" for any other
    method)."""
    from worker_service.models.layers import Linear  # layers imports quant

    if method == "int8":
        return f"int8, {quantize_linears(model, method)} linear layers as Q8_0 blocks"
    if method != "int4":
        return ""
    head = getattr(model, "lm_head", None)
    linears = [
        m for m in model.modules()
        if isinstance(m, Linear) and m.quant is None and m.in_features % BLOCK == 0
    ]  # fmt: skip
    ops = cpu_ops.load()
    for linear in linears:
        if linear is head:
            linear.quantize()  # Q8_0: the logits are where 4 bits hurt most (llama.cpp's Q4 too)
        else:
            linear.set_blocks(quantize_q4_1(linear.weight.data, group, ops))
    return (
        f"int4, {len(linears) - (head in linears)} linear layers as Q4_1 blocks in groups of "
        f"{group}" + (", the output head as Q8_0" if head in linears else "")
    )
