"""Dense decoders that are Llama plus a detail: Mistral (sliding window), Phi-3 /
Phi-4-mini (fused checkpoint projections, longrope, partial rotary, sliding window) and
SmolLM3 (NoPE layers)."""

from __future__ import annotations

import torch

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig
from worker_service.models.llama import DecoderLayer, LlamaForCausalLM
from worker_service.parallel import TPGroup


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini: Llama math; the checkpoint stores qkv_proj and gate_up_proj
    already fused, split here into the q/k/v and gate/up pieces the loader places (this
    rank's rows of each under tensor parallelism). Rope (longrope, partial_rotary_factor)
    comes from config.RopeConfig."""

    supported_features: tuple[str, ...] = ("sliding_window",)

    def split_checkpoint(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        prefix, _, leaf = name.rpartition(".")
        prefix, _, proj = prefix.rpartition(".")
        if proj not in ("qkv_proj", "gate_up_proj"):
            return [(name, tensor)]
        cfg, s, hd = self.config, self.shard, self.config.head_dim
        if proj == "qkv_proj":  # [(heads + 2 * kv_heads) * head_dim, ...]
            q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
            kv_rows = slice(s.kv_start * hd, s.kv_end * hd)
            pieces = {
                "q_proj": tensor[s.q_start * hd : (s.q_start + s.num_heads) * hd],
                "k_proj": tensor[q:][kv_rows],
                "v_proj": tensor[q + kv :][kv_rows],
            }
        else:  # [2 * intermediate, hidden]: gate rows, then up rows
            inter = cfg.intermediate_size
            pieces = {
                "gate_proj": tensor[s.mlp_start : s.mlp_end],
                "up_proj": tensor[inter + s.mlp_start : inter + s.mlp_end],
            }
        return [(f"{prefix}.{part}.{leaf}", piece) for part, piece in pieces.items()]


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window on every layer (`sliding_window`, when set)."""

    supported_features: tuple[str, ...] = ("sliding_window",)


class NoPEDecoderLayer(DecoderLayer):
    """A decoder layer without rotary embedding: it rotates by cos 1, sin 0 (exactly x)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cis: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = torch.ones_like(cis[0])
        return super().forward(x, residual, (cos, torch.zeros_like(cis[1])))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama whose layers with no_rope_layers[i] == 0 use no positional encoding."""

    supported_features: tuple[str, ...] = ("no_rope_layers",)

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        super().__init__(cfg, backend, tp)
        flags = cfg.raw.get("no_rope_layers") or [1] * cfg.num_layers
        if len(flags) != cfg.num_layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {cfg.num_layers} layers")
        for layer, use_rope in zip(self.layers, flags, strict=True):
            if not use_rope:
                layer.__class__ = NoPEDecoderLayer
