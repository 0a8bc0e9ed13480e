"""Rotary position embedding with HF's scaling types: default, linear, dynamic (NTK), llama3,
yarn and longrope, computed as transformers' modeling_rope_utils computes them (same float32
operations in the same order, so float32 runs match HF token for token).

Two types depend on the length of the sequence, as HF's `dynamic_rope_update` applies them
during `generate`: HF picks the frequencies from `seq_len = max(position_ids) + 1` of each
forward, i.e. the prompt length for every prompt token and `position + 1` for each decoded
token. Here a token's length is `max(prompt_len, position + 1)` (the step's metadata carries
each request's prompt length), so chunked prefill rotates exactly as HF's whole prefill does.
- dynamic: lengths above max_position_embeddings get NTK-scaled frequencies for that length.
- longrope: lengths above original_max_position_embeddings use the long factors.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from worker_service.models.config import RopeConfig
from worker_service.models.context import current_attention_metadata


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    """How many leading dims of a head rotate (partial_rotary_factor, as HF rounds it)."""
    return int(head_dim * rope.partial_rotary_factor)


def _exponents(dim: int) -> torch.Tensor:
    """[dim // 2] float32: (0, 2, 4, ...) / dim, HF's int64 arange cast to float."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _llama3(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
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


def _yarn(dim: int, rope: RopeConfig) -> torch.Tensor:
    base, factor = rope.theta, rope.factor

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _dynamic_base(rope: RopeConfig, dim: int, seq_len: float) -> float:
    """NTK-aware base for `seq_len` (a Python number, as HF's init computes it)."""
    max_pos, factor = rope.max_position_embeddings, rope.factor
    return rope.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))


def dynamic_inv_freq(rope: RopeConfig, dim: int, lengths: torch.Tensor) -> torch.Tensor:
    """lengths [n] int64 -> [n, dim // 2] float32: HF's dynamic NTK frequencies for a tensor
    seq_len (float32 arithmetic, as `dynamic_rope_update` runs it), row by row."""
    seq = torch.maximum(lengths, torch.tensor(rope.max_position_embeddings, dtype=lengths.dtype))
    factor = rope.factor
    base = rope.theta * ((factor * seq / rope.max_position_embeddings) - (factor - 1)) ** (
        dim / (dim - 2)
    )  # [n] float32
    return 1.0 / (base.unsqueeze(1) ** _exponents(dim).unsqueeze(0))


def rope_inv_freq(dim: int, rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """[dim // 2] float32 inverse frequencies of the `dim` rotating dims, at the model's own
    length (dynamic), or with the long factors (longrope, `long`)."""
    if rope.rope_type == "yarn":
        return _yarn(dim, rope)
    if rope.rope_type == "dynamic":
        base = _dynamic_base(rope, dim, rope.max_position_embeddings)
        return 1.0 / (base ** _exponents(dim))
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor)
        if factors.numel() != dim // 2:
            raise ValueError(f"longrope factors have {factors.numel()} entries, need {dim // 2}")
        return 1.0 / (factors * rope.theta ** _exponents(dim))
    inv = 1.0 / (rope.theta ** _exponents(dim))
    if rope.rope_type == "linear":
        inv /= rope.factor
    elif rope.rope_type == "llama3":
        inv = _llama3(inv, rope)
    return inv


def rope_attention_factor(rope: RopeConfig) -> float:
    """The scale HF applies to cos and sin (yarn's mscale, longrope's), 1.0 otherwise."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    factor = rope.factor
    if rope.rope_type == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rope.mscale and rope.mscale_all_dim:
            return float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        return mscale(factor)
    if rope.rope_type == "longrope" and factor > 1.0:
        return math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def _tables(inv: torch.Tensor, positions: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)  # [positions, d/2]
    if scale == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * scale, freqs.sin() * scale


class RotaryEmbedding(nn.Module):
    """Rotary embedding in HF's half-split layout: dim i rotates with dim i + rotary_dim/2.

    Keeping HF's layout (rather than interleaving pairs) keeps the element order of
    every q.k dot product, so bf16 attention rounds exactly as HF's does. cos/sin are
    computed in float32 and cast to the activation dtype; the rotation is done in that
    dtype with HF's order of roundings (x*cos + rotate_half(x)*sin). With a partial rotary
    factor only the first rotary_dim dims of each head rotate (Phi-4-mini); the rest pass.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.rope, self.dim = rope, rotary_dim(head_dim, rope)
        self.full = self.dim == head_dim
        self.scale = rope_attention_factor(rope)
        cos, sin = _tables(rope_inv_freq(self.dim, rope), max_positions, self.scale)
        self.cos_table: torch.Tensor  # [max_positions, rotary_dim // 2] float32
        self.sin_table: torch.Tensor
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)
        self.long_cos_table: torch.Tensor  # longrope: the long factors' tables
        self.long_sin_table: torch.Tensor
        if rope.rope_type == "longrope":
            long_cos, long_sin = _tables(
                rope_inv_freq(self.dim, rope, True), max_positions, self.scale
            )
            self.register_buffer("long_cos_table", long_cos, persistent=False)
            self.register_buffer("long_sin_table", long_sin, persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens] -> cos, sin [num_tokens, 1, rotary_dim // 2] in `dtype`, once per step."""
        cos = self.cos_table.index_select(0, positions)
        sin = self.sin_table.index_select(0, positions)
        if self.rope.length_dependent:
            cos, sin = self._by_length(positions, cos, sin)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def _by_length(
        self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the rows of tokens whose sequence length calls for other frequencies."""
        lengths = sequence_lengths(positions)  # [num_tokens] int64
        if self.rope.rope_type == "longrope":
            long = (lengths > self.rope.original_max_position_embeddings).unsqueeze(1)
            cos = torch.where(long, self.long_cos_table.index_select(0, positions), cos)
            sin = torch.where(long, self.long_sin_table.index_select(0, positions), sin)
            return cos, sin
        rows = (lengths > self.rope.max_position_embeddings).nonzero().squeeze(1)
        if rows.numel() == 0:
            return cos, sin
        inv = dynamic_inv_freq(self.rope, self.dim, lengths[rows].cpu()).to(cos.device)
        freqs = positions[rows].float().unsqueeze(1) * inv  # [rows, rotary_dim // 2]
        cos, sin = cos.clone(), sin.clone()
        cos[rows], sin[rows] = freqs.cos() * self.scale, freqs.sin() * self.scale
        return cos, sin

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [num_tokens, heads, head_dim] -> rotated, same shape and dtype."""
        cos, sin = cos_sin
        dim = 2 * cos.shape[-1]
        if dim != x.shape[-1]:  # partial rotary: the tail passes unrotated
            rotated = RotaryEmbedding.rotate(x[..., :dim], cos_sin)
            return torch.cat((rotated, x[..., dim:]), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim // 2] each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def sequence_lengths(positions: torch.Tensor) -> torch.Tensor:
    """[num_tokens] -> [num_tokens] int64: max(prompt_len, position + 1) of each token, the
    length HF's generate rotates it at (position + 1 outside a step with prompt lengths)."""
    lengths = positions.to(torch.int64) + 1
    meta = current_attention_metadata()
    if meta is None or not meta.prompt_lens_cpu:
        return lengths
    prompt = torch.repeat_interleave(
        torch.tensor(meta.prompt_lens_cpu, dtype=torch.int64),
        torch.tensor(meta.query_lens_cpu, dtype=torch.int64),
    ).to(positions.device)
    return torch.maximum(lengths, prompt)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): each token has a (temporal, height, width) position; the rotary
    frequencies are split by `mrope_section` and section i rotates with axis i % 3, as HF's
    Qwen2VLRotaryEmbedding recomposes them. Positions [num_tokens] mean all three axes
    equal (text), which is plain RoPE."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__(head_dim, max_positions, rope)
        if rope.length_dependent:
            raise ValueError(f"M-RoPE with rope_type {rope.rope_type!r} is not implemented")
        if sum(rope.mrope_section) != self.dim // 2:
            raise ValueError(
                f"mrope_section {list(rope.mrope_section)} must sum to {self.dim // 2} "
                "(half the rotary dims)"
            )
        axis = [i % 3 for i, n in enumerate(rope.mrope_section) for _ in range(n)]
        self.axis: torch.Tensor  # [rotary_dim // 2]: the position axis of each frequency
        self.register_buffer("axis", torch.tensor(axis), persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] or [3, num_tokens] -> cos, sin [num_tokens, 1, dim // 2]."""
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        index = positions.T.gather(1, self.axis.expand(positions.shape[1], -1))  # [n, d/2]
        freq = torch.arange(self.dim // 2, device=positions.device).expand_as(index)
        cos = self.cos_table[index, freq]
        sin = self.sin_table[index, freq]
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
