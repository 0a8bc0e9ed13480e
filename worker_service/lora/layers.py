"""LoRALinear: a base projection plus the step's adapters, applied per token segment.

The runner orders a step's requests so that the tokens of one adapter are contiguous
(decode-first, then grouped by adapter), and `LoRABatch.segments` lists each run as
(slot, start, end). For every segment one pair of small GEMMs adds
`(x[start:end] A[slot]^T) B[slot]^T` (the scaling is folded into B) to the base output,
so base-model tokens cost nothing and the base layer itself is untouched.

Merged layers (qkv, gate_up) keep one A/B pair per part: A [slots, parts * R, in] stacks the
parts' A rows (one GEMM serves q, k and v), B [slots, out, R] holds each part's B in that
part's output rows, and each part adds `xa[:, its R ranks] B_part^T` into its own output
columns. Ranks below R are zero-padded; parts an adapter does not target are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRABatch:
    """The current step's adapter segments, shared by every LoRALinear of a model."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end)


@dataclass(frozen=True)
class LoRAPart:
    """One checkpoint projection inside a (possibly merged) layer."""

    name: str  # q_proj, k_proj, ... as PEFT names it
    out_start: int  # its output columns in the merged layer: [out_start, out_end)
    out_end: int


class LoRALinear(nn.Module):
    """`base(x)` plus, on each segment's tokens, the slot's low-rank update."""

    def __init__(
        self,
        base: nn.Module,
        parts: list[LoRAPart],
        in_features: int,
        num_slots: int,
        max_rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base, self.parts, self.batch, self.max_rank = base, parts, batch, max_rank
        out_features = parts[-1].out_end
        self.lora_a = torch.zeros(
            num_slots, len(parts) * max_rank, in_features, dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(num_slots, out_features, max_rank, dtype=dtype, device=device)
        self.targeted = [[False] * len(parts) for _ in range(num_slots)]  # [slot][part]

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (A [r, in], B [part_out, r]) per part (None: not adapted)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for p, (part, pair) in enumerate(zip(self.parts, pairs, strict=True)):
            self.targeted[slot][p] = pair is not None
            if pair is None:
                continue
            a, b = pair
            r0, r = p * self.max_rank, a.shape[0]
            self.lora_a[slot, r0 : r0 + r].copy_(a)
            self.lora_b[slot, part.out_start : part.out_end, :r].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [n, out]
        if not self.batch.segments:
            return y
        x = x.to(self.lora_a.dtype)  # float32 on CPU (a no-op for a float32 model)
        rank = self.max_rank
        for slot, start, end in self.batch.segments:
            xa = torch.mm(x[start:end], self.lora_a[slot].t())  # [m, parts * R]
            for p, part in enumerate(self.parts):
                if self.targeted[slot][p]:
                    b_t = self.lora_b[slot, part.out_start : part.out_end].t()  # [R, part_out]
                    delta = torch.mm(xa[:, p * rank : (p + 1) * rank], b_t)  # [m, part_out]
                    y[start:end, part.out_start : part.out_end] += delta  # bf16 y: rounded once
        return y


def apply_segments_reference(
    x: torch.Tensor, layer: LoRALinear, slot_of_token: list[int]
) -> torch.Tensor:
    """The per-token, per-part loop the segment GEMMs must equal (tests): [n, out] deltas,
    zero where the token's slot is -1 (the base model)."""
    out = torch.zeros(x.shape[0], layer.lora_b.shape[1], dtype=layer.lora_a.dtype)
    rank = layer.max_rank
    for i, slot in enumerate(slot_of_token):
        if slot < 0:
            continue
        for p, part in enumerate(layer.parts):
            a = layer.lora_a[slot, p * rank : (p + 1) * rank]  # [R, in]
            b = layer.lora_b[slot, part.out_start : part.out_end]  # [part_out, R]
            out[i, part.out_start : part.out_end] = b @ (a @ x[i].to(a.dtype))
    return out
