"""Qwen2-VL's vision transformer: 3D patch embedding, blocks with 2D rotary embeddings
and full attention within each image (frame), and the 2x2 PatchMerger into the LM's width.

Computed as transformers' Qwen2VisionTransformerPretrainedModel computes it (same float32
operations in the same order); parameter names are HF's, so checkpoints load by name.
Images arrive as the processor's flattened patches [patches, C * T * P * P] with their
(t, h, w) grid; the patches of each 2x2 merge block are consecutive.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def vision_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """grid_thw [images, 3] -> [patches, 2] (row, column) of each patch, in the processor's
    block-major order (each merge x merge block's patches consecutive)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).unsqueeze(1).expand(-1, w)
        cols = torch.arange(w).unsqueeze(0).expand(h, -1)
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)


def frame_lengths(grid_thw: torch.Tensor) -> list[int]:
    """Patches of each attention segment: one per frame (h * w), t frames per image."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_vision_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [patches, heads, head_dim]; cos, sin [patches, head_dim] -> rotated (in float32)."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    q_out = qf * cos + _rotate_half(qf) * sin
    k_out = kf * cos + _rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


class VisionRotary(nn.Module):
    """Axial 2D rope: a quarter of the head's frequencies per axis, rows then columns."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial = head_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [patches, 2] -> cos, sin [patches, head_dim] float32."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [patches, 2, d/4]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [patches, d/2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


class PatchEmbed(nn.Module):
    """[patches, C * T * P * P] -> [patches, embed_dim] by a Conv3d over each patch."""

    def __init__(self, patch: int, temporal: int, channels: int, embed_dim: int) -> None:
        super().__init__()
        self.shape = (-1, channels, temporal, patch, patch)
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(channels, embed_dim, kernel, stride=kernel, bias=False)
        self.embed_dim = embed_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(-1, self.embed_dim)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment (an image's frame, or a window)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, lengths: list[int], cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_vision_rope(q, k, *cos_sin)  # [n, heads, head_dim] each
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2) for t in (q, k, v))
        outs = [
            F.scaled_dot_product_attention(a, b, c, scale=self.head_dim**-0.5)
            for a, b, c in zip(qs, ks, vs, strict=True)
        ]  # each [1, heads, len, head_dim]
        out = torch.cat(outs, dim=2).squeeze(0).transpose(0, 1)  # [n, heads, head_dim]
        return self.proj(out.reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), ACT2FN[act], nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_hidden: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, heads)
        self.mlp = VisionMlp(dim, mlp_hidden, act)

    def forward(
        self, x: torch.Tensor, lengths: list[int], cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos_sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge x merge block of patch features -> one LM embedding (LayerNorm, 2 linears)."""

    def __init__(self, dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """pixel patches [patches, C * T * P * P] + grid_thw [images, 3] -> [patches / merge^2,
    hidden] LM embeddings, the images' rows in order."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = int(cfg.get("embed_dim", 1280)), int(cfg.get("num_heads", 16))
        self.merge = int(cfg.get("spatial_merge_size", 2))
        self.patch_embed = PatchEmbed(
            int(cfg.get("patch_size", 14)),
            int(cfg.get("temporal_patch_size", 2)),
            int(cfg.get("in_channels", 3)),
            dim,
        )
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.rotary_pos_emb = VisionRotary(dim // heads, theta)
        mlp_hidden = int(dim * cfg.get("mlp_ratio", 4))
        act = str(cfg.get("hidden_act", "quick_gelu"))
        self.blocks = nn.ModuleList(
            VisionBlock(dim, heads, mlp_hidden, act) for _ in range(int(cfg.get("depth", 32)))
        )
        self.merger = PatchMerger(int(cfg.get("hidden_size", 3584)), dim, self.merge)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cos_sin = self.rotary_pos_emb(vision_positions(grid_thw, self.merge))
        lengths = frame_lengths(grid_thw)
        x = self.patch_embed(pixels)  # [patches, embed_dim]
        for block in self.blocks:
            x = block(x, lengths, cos_sin)
        return self.merger(x)
