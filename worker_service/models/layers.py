"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding, fused MLP.

Precision rule: weights and matmuls run in the model dtype (bf16 by default),
while RMSNorm, RoPE and the logits are computed in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.models.config import RopeConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in float32.

    `forward(x, residual)` fuses the residual add and keeps the residual stream in
    float32: it returns `(norm(x + residual) in x's dtype, x + residual in float32)`.
    A bf16 residual stream loses enough precision to flip close greedy choices.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.size = (size,)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """[..., size] -> [..., size] in x's dtype."""
        return F.rms_norm(x.float(), self.size, self.weight, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, size] (model dtype), residual [n, size] float32 or None."""
        stream = x.float() if residual is None else residual + x  # [n, size] float32
        return F.rms_norm(stream, self.size, self.weight, self.eps).to(x.dtype), stream


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, as HF computes them (llama3 scaling too)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type != "llama3":
        return inv
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def interleave_permutation(head_dim: int) -> torch.Tensor:
    """[head_dim] index: HF's half-split rotary layout -> interleaved pairs.

    HF rotates dim i with dim i + head_dim/2; permuting q/k projection rows by this
    index makes the pairs adjacent (2i, 2i+1), so RoPE is one complex multiply.
    q.k dot products are unchanged because q and k get the same permutation.
    """
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()


class RotaryEmbedding(nn.Module):
    """Rotary embedding on interleaved q/k (see `interleave_permutation`), in float32."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, rope))
        # [max_positions, head_dim // 2] complex64
        self.register_buffer("cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, 1, head_dim // 2] complex factors, once per step."""
        return self.cis.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, heads, head_dim] (interleaved) rotated by cis; same dtype as x."""
        n, heads, dim = x.shape
        pairs = torch.view_as_complex(x.float().reshape(n, heads, dim // 2, 2))
        return torch.view_as_real(pairs * cis).reshape(n, heads, dim).to(x.dtype)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [n, inter] each
        return self.down_proj(F.silu(gate) * up)
