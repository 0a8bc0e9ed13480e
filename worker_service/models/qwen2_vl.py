"""Qwen2-VL and Qwen2.5-VL: their vision transformers (qwen2_vl_vision,
qwen2_5_vl_vision) and a Qwen2 decoder (q/k/v bias)
whose rotary embedding is M-RoPE, on the paged-attention path.

The runner passes positions [3, num_tokens] (temporal, height, width; see
worker_service.mrope) for steps holding a request with images, [num_tokens] otherwise;
image rows come from `encode_images` and are scattered at the image-pad tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelArchConfig
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from worker_service.models.qwen2_vl_vision import Qwen2VisionTransformer
from worker_service.models.rope import MRotaryEmbedding
from worker_service.parallel import TPGroup


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2VLForConditionalGeneration (images; videos are not served)."""

    splits_for_tp = False  # its vision tower is not split across ranks
    supported_features: tuple[str, ...] = ("mrope_section",)
    uses_mrope = True  # the runner computes 3D positions for its requests with images

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TPGroup | None = None
    ) -> None:
        super().__init__(cfg, backend, tp)
        raw = cfg.raw
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope)
        vision = dict(raw.get("vision_config") or {})
        self.visual = self.build_vision(vision)
        self.spatial_merge_size = int(vision.get("spatial_merge_size", 2))
        self.image_token_id = int(raw.get("image_token_id", 151655))

    @staticmethod
    def build_vision(vision: dict[str, object]) -> torch.nn.Module:
        return Qwen2VisionTransformer(vision)

    @classmethod
    def adapt_config(cls, cfg: ModelArchConfig) -> ModelArchConfig:
        rope = cfg.rope
        if not rope.mrope_section:  # HF's default split
            rope = dataclasses.replace(rope, mrope_section=(16, 24, 24))
        return dataclasses.replace(cfg, attention_bias=True, rope=rope)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """HF checkpoint name -> parameter name, for both layouts: the old one (model.*,
        visual.*, lm_head) and transformers 5's (model.language_model.*, model.visual.*)."""
        return name.removeprefix("model.").removeprefix("language_model.")

    def encode_images(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """pixel_values [num_images, patches, C*T*P*P], grid_thw [num_images, 3] -> per image
        [t * h * w / merge^2, hidden] embeddings."""
        if grid_thw is None or grid_thw.shape != (pixel_values.shape[0], 3):
            raise ValueError("a Qwen2-VL image needs its (t, h, w) patch grid")
        merge = self.spatial_merge_size
        for (t, h, w), pixels in zip(grid_thw.tolist(), pixel_values, strict=True):
            if t * h * w != pixels.shape[0] or h % merge or w % merge:
                raise ValueError(
                    f"an image grid of {t}x{h}x{w} patches does not fit its "
                    f"{pixels.shape[0]} patches (merged {merge}x{merge})"
                )
        dtype = self.embed_tokens.weight.dtype
        out = [
            self.visual(pixels.to(dtype), grid.unsqueeze(0))
            for pixels, grid in zip(pixel_values, grid_thw, strict=True)
        ]
        return out


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2_5_VLForConditionalGeneration: the same decoder and M-RoPE (still images have
    no temporal spacing), a vision tower with windowed attention and RMSNorm."""

    @staticmethod
    def build_vision(vision: dict[str, object]) -> torch.nn.Module:
        return Qwen2_5_VisionTransformer(vision)
