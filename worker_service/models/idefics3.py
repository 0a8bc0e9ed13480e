"""Idefics3 / SmolVLM: transformers' Idefics3 vision transformer (SigLIP-style), its
pixel-shuffle connector, and Tessera's Llama decoder on the paged-attention path.

An image arrives as its tiles, [tiles, 3 or 4, H, W]: the processor's pixel values, with
its pixel attention mask as a fourth channel when it gave one. Each tile becomes
`image_seq_len` embeddings; the runner scatters them, in order, at the image tokens of
the image's placeholder range (which also holds the tile-layout tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig
from worker_service.models.llama import LlamaForCausalLM
from worker_service.parallel import TPGroup


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """Idefics3ForConditionalGeneration with a Llama language model (SmolVLM: SmolLM2)."""

    splits_for_tp = False  # its vision tower is not split across ranks

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        super().__init__(cfg, backend, tp)
        from transformers import Idefics3Config
        from transformers.models.idefics3.modeling_idefics3 import (
            Idefics3Connector,
            Idefics3VisionTransformer,
        )

        hf_config = Idefics3Config(**{k: v for k, v in cfg.raw.items() if k != "model_type"})
        vision_config: Any = hf_config.vision_config
        self.vision_model = Idefics3VisionTransformer(vision_config)
        self.connector = Idefics3Connector(hf_config)
        self.patch_size = int(vision_config.patch_size)
        self.image_token_id = int(hf_config.image_token_id)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """HF names (model.text_model.*, model.vision_model.*, model.connector.*, lm_head)
        -> parameter names (the decoder's at the top level)."""
        name = name.removeprefix("model.").removeprefix("text_model.")
        return "" if name.endswith("position_ids") else name

    def encode_images(self, tiles: torch.Tensor) -> list[torch.Tensor]:
        """tiles [num_images, tiles, 3 or 4, H, W] -> per image [tiles * seq, hidden]."""
        dtype = self.connector.modality_projection.proj.weight.dtype
        out = []
        for image in tiles:
            pixels = image[:, :3].to(dtype)  # [tiles, 3, H, W]
            mask = image[:, 3] > 0 if image.shape[1] == 4 else torch.ones_like(pixels[:, 0])
            p = self.patch_size
            patch_mask = mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0
            hidden = self.vision_model(
                pixel_values=pixels, patch_attention_mask=patch_mask
            ).last_hidden_state  # [tiles, patches, vision_hidden]
            features = self.connector(hidden)  # [tiles, seq, hidden]
            out.append(features.reshape(-1, features.shape[-1]))
        return out
