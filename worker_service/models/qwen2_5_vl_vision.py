"""Qwen2.5-VL's vision transformer: Qwen2-VL's patch embedding and 2D rope, with RMSNorm,
a gated (SiLU) MLP with biases, and windowed attention: the merged tokens are regrouped
window by window (window_size pixels a side), every block attends within its window
except the `fullatt_block_indexes` ones, which attend over the whole image (frame).

Computed as transformers' Qwen2_5_VisionTransformerPretrainedModel computes it; HF's
parameter names, so checkpoints load by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_service.models.qwen2_vl_vision import (
    PatchEmbed,
    VisionAttention,
    VisionRotary,
    frame_lengths,
    vision_positions,
)


class VisionRMSNorm(nn.Module):
    """HF's Qwen2_5_VLRMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedVisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class WindowedBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_hidden: int, act: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = VisionRMSNorm(dim), VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, heads)
        self.mlp = GatedVisionMlp(dim, mlp_hidden, act)

    def forward(
        self, x: torch.Tensor, lengths: list[int], cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos_sin)
        return x + self.mlp(self.norm2(x))


class RMSPatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = VisionRMSNorm(context_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def window_order(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(order of the merged tokens, window by window [tokens / merge^2], the patch count of
    each window): each frame's merged grid is cut into window x window tiles (`window`
    merged tokens a side, the last ones cut short), read row-major tile by tile."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for frame in index:
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    tile = frame[r : r + window, c : c + window].flatten()
                    order.append(tile + base)
                    lengths.append(tile.numel() * merge**2)
        base += t * gh * gw
    return torch.cat(order).to(grid_thw.device), lengths


class Qwen2_5_VisionTransformer(nn.Module):
    """pixel patches [patches, C * T * P * P] + grid_thw [images, 3] -> [patches / merge^2,
    out_hidden_size] LM embeddings, in the images' own (not the windows') order."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = int(cfg.get("hidden_size", 1280)), int(cfg.get("num_heads", 16))
        self.merge = int(cfg.get("spatial_merge_size", 2))
        patch = int(cfg.get("patch_size", 14))
        self.window = int(cfg.get("window_size", 112)) // self.merge // patch  # merged tokens
        self.full_blocks = {int(i) for i in cfg.get("fullatt_block_indexes", (7, 15, 23, 31))}
        self.patch_embed = PatchEmbed(
            patch, int(cfg.get("temporal_patch_size", 2)), int(cfg.get("in_channels", 3)), dim
        )
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.rotary_pos_emb = VisionRotary(dim // heads, theta)
        mlp_hidden, act = (
            int(cfg.get("intermediate_size", 3420)),
            str(cfg.get("hidden_act", "silu")),
        )
        self.blocks = nn.ModuleList(
            WindowedBlock(dim, heads, mlp_hidden, act) for _ in range(int(cfg.get("depth", 32)))
        )
        self.merger = RMSPatchMerger(int(cfg.get("out_hidden_size", 3584)), dim, self.merge)

    def _by_window(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """[patches, d] -> the same rows with each merge block moved to its window slot."""
        unit = self.merge**2
        return x.reshape(-1, unit, x.shape[-1])[order].reshape(x.shape)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        order, window_lengths = window_order(grid_thw, self.merge, self.window)
        frames = frame_lengths(grid_thw)
        x = self._by_window(self.patch_embed(pixels), order)  # [patches, hidden]
        cos, sin = self.rotary_pos_emb(vision_positions(grid_thw, self.merge))
        cos_sin = (self._by_window(cos, order), self._by_window(sin, order))
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in self.full_blocks else window_lengths, cos_sin)
        return self.merger(x)[torch.argsort(order)]
