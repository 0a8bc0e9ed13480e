"""LoRALinear: a base projection plus the step's adapters, applied per token segment.

The runner orders a step's requests so that the tokens of one adapter are contiguous
(decode-first, then grouped by adapter), and `LoRABatch.segments` lists each run as
(slot, start, end). For every segment one pair of small GEMMs adds
`(x[start:end] A[slot]^T) B[slot]^T` (the scaling is folded into B) to the base output,
so base-model tokens cost nothing and the base layer itself is untouched.

Merged layers (qkv, gate_up) keep one A/B pair per part: A [slots, parts * R, in] stacks the
parts' A rows, B [slots, out, parts * R] is block-diagonal (part p's output columns read
only part p's R ranks), so one pair of GEMMs serves q, k and v together.
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
        ranks = len(parts) * max_rank
        self.lora_a = torch.zeros(num_slots, ranks, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, out_features, ranks, dtype=dtype, device=device)

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (A [r, in], B [part_out, r]) per part (None: not adapted)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for p, (part, pair) in enumerate(zip(self.parts, pairs, strict=True)):
            if pair is None:
                continue
            a, b = pair
            r0, r = p * self.max_rank, a.shape[0]
            self.lora_a[slot, r0 : r0 + r].copy_(a)
            self.lora_b[slot, part.out_start : part.out_end, r0 : r0 + r].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [n, out]
        for slot, start, end in self.batch.segments:
            xa = torch.mm(x[start:end].to(self.lora_a.dtype), self.lora_a[slot].t())  # [m, P*R]
            y[start:end] += torch.mm(xa, self.lora_b[slot].t())  # [m, out]
        return y


def apply_segments_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_of_token: list[int]
) -> torch.Tensor:
    """The per-token loop the segment GEMMs must equal (tests): [n, out] deltas, zero where
    the token's slot is -1 (the base model)."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=a.dtype, device=x.device)
    for i, slot in enumerate(slot_of_token):
        if slot >= 0:
            out[i] = b[slot] @ (a[slot] @ x[i].to(a.dtype))
    return out
