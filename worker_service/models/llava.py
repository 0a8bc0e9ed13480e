"""LLaVA: a CLIP vision tower (transformers' own module), a two-layer projector, and
Tessera's Llama decoder on the paged-attention path.

The decoder is the parent class, so the runner drives it like any Llama; images come in
through `encode_images`, whose rows the runner scatters into `forward`'s `input_embeds`
at the image-token positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig
from worker_service.models.llama import LlamaForCausalLM
from worker_service.parallel import TPGroup


class LlavaProjector(nn.Module):
    """Vision features -> LM embeddings: linear, activation, linear (HF names kept)."""

    def __init__(self, vision_dim: int, text_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LlavaForConditionalGeneration with a Llama/Mistral language model."""

    splits_for_tp = False  # its vision tower is not split across ranks

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        super().__init__(cfg, backend, tp)
        from transformers import AutoConfig, AutoModel

        raw = cfg.raw
        vision_raw = dict(raw["vision_config"])
        vision_cfg = AutoConfig.for_model(vision_raw.pop("model_type", "clip_vision_model"))
        vision_cfg.update(vision_raw)
        self.vision_tower = AutoModel.from_config(vision_cfg)
        layer = raw.get("vision_feature_layer", -2)
        self.feature_layers: list[int] = layer if isinstance(layer, list) else [layer]
        self.drop_cls = raw.get("vision_feature_select_strategy", "default") == "default"
        self.image_token_id = int(raw.get("image_token_index", raw.get("image_token_id", 32000)))
        self.multi_modal_projector = LlavaProjector(
            vision_cfg.hidden_size * len(self.feature_layers),
            cfg.hidden_size,
            raw.get("projector_hidden_act", "gelu"),
            bool(raw.get("multimodal_projector_bias", True)),
        )

    @classmethod
    def adapt_config(cls, cfg: ModelArchConfig) -> ModelArchConfig:
        text_type = cfg.raw.get("text_config", {}).get("model_type", "llama")
        return dataclasses.replace(cfg, attention_bias=text_type == "qwen2")

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """HF checkpoint name -> parameter name, for both layouts: the old one
        (language_model.model.*, language_model.lm_head, vision_tower.*) and the one of
        transformers >= 4.52 (model.language_model.*, lm_head, model.vision_tower.*)."""
        name = name.removeprefix("model.")
        name = name.removeprefix("language_model.").removeprefix("model.")
        if name.startswith("vision_tower.vision_model."):  # CLIPVisionModel before v5
            name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
        return "" if name.endswith("position_ids") else name

    def encode_images(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [num_images, 3, H, W] -> per image [num_patches, hidden] embeddings."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        out: Any = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True)
        states = [out.hidden_states[i] for i in self.feature_layers]  # [n, 1 + patches, d]
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        return list(self.multi_modal_projector(torch.cat(states, dim=-1)))
