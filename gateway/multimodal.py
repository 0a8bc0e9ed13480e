"""Image preprocessing shared by the gateway and the offline API.

The model's own HF processor (AutoProcessor from the model directory) turns text with
image placeholders plus PIL images into input ids with the placeholders expanded and
the pixel values; each image becomes a `MultiModalInput` (placeholder offset and length,
a content hash of the image, a TensorHandle to its pixels). Whoever exports the handles
owns them and closes them when the request ends (`PreparedImages.close`).

Images arrive as `data:` URLs (base64 PNG/JPEG/WebP) checked against byte, pixel and
aspect-ratio caps, and against the size the processor would resize them to, from the
header before anything is decoded; anything wrong is an InvalidRequest (400).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import itertools
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from gateway.errors import InvalidRequest
from services.config import GatewayConfig
from services.types import MultiModalInput

if TYPE_CHECKING:  # torch comes in with the first image, so text-only gateways never load it
    import torch

    from services.tensor_handles import ExportedTensor, ExportMode

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
log = logging.getLogger(__name__)


MAX_PLANNED_PIXELS = 4096 * 4096  # the processor's resized image (48 MiB as RGB bytes)


@dataclass(frozen=True)
class ResizeRule:
    """How a model's image processor resizes an image before cropping or tiling it, read from
    its config: a bound on the pixels the processor will allocate for an image of a given
    size. HF resizes keep the aspect ratio, so a shortest-edge resize of a 400000x1 image
    asks for 32x12,800,000 pixels; the gateway refuses such an image before decoding it.
    Unknown rules plan the image's own size (an over-estimate refuses, never allocates)."""

    height: int = 0  # a fixed output size (size={"height", "width"})
    width: int = 0
    shortest_edge: int = 0  # scale the short side to this (LLaVA / CLIP) ...
    longest_edge: int = 0  # ... and/or the long side to at most this (Idefics3)
    max_height: int = 0  # fit inside max_height x max_width
    max_width: int = 0
    max_pixels: int = 0  # a pixel budget (Qwen2-VL's smart resize)
    tile: int = 0  # sides round up to multiples of this, plus one global tile (Idefics3)
    resizes: bool = True  # False: do_resize is off, the processor keeps the image's size

    @classmethod
    def of(cls, image_processor: Any) -> ResizeRule:
        """The rule of an HF image processor (its `size`, `max_image_size`, `do_resize`)."""
        size = _entries(getattr(image_processor, "size", None))
        tile = 0
        if getattr(image_processor, "do_image_splitting", False):
            tile = _entries(getattr(image_processor, "max_image_size", None)).get("longest_edge", 0)
        if hasattr(image_processor, "temporal_patch_size"):  # Qwen2-VL family: edges are pixels
            budget = int(getattr(image_processor, "max_pixels", 0) or size.get("longest_edge", 0))
            return cls(max_pixels=budget, resizes=bool(budget))
        return cls(
            size.get("height", 0), size.get("width", 0), size.get("shortest_edge", 0),
            size.get("longest_edge", 0), size.get("max_height", 0), size.get("max_width", 0),
            size.get("max_pixels", 0), tile, bool(getattr(image_processor, "do_resize", True)),
        )  # fmt: skip

    @property
    def known(self) -> bool:
        """Whether the rule bounds the output (else only the caps on the input apply)."""
        fields = (self.height and self.width, self.shortest_edge, self.longest_edge)
        return not self.resizes or any(fields) or bool(self.max_pixels or self.max_height)

    def planned_pixels(self, width: int, height: int) -> int:
        """Pixels of the image the processor makes of a `width` x `height` one (at most)."""
        w, h = float(width), float(height)
        if not self.resizes:
            pass
        elif self.max_pixels:
            return self.max_pixels
        elif self.height and self.width:
            w, h = float(self.width), float(self.height)
        else:
            if self.shortest_edge:
                w, h = _scaled(w, h, self.shortest_edge / min(w, h))
            if self.longest_edge and (not self.shortest_edge or max(w, h) > self.longest_edge):
                w, h = _scaled(w, h, self.longest_edge / max(w, h))
            if self.max_height and self.max_width:
                w, h = _scaled(w, h, min(self.max_height / h, self.max_width / w))
        if self.tile:
            w, h = math.ceil(w / self.tile) * self.tile, math.ceil(h / self.tile) * self.tile
        return math.ceil(w) * math.ceil(h) + self.tile**2


def _scaled(w: float, h: float, scale: float) -> tuple[float, float]:
    return max(1.0, w * scale), max(1.0, h * scale)


def _entries(size: Any) -> dict[str, int]:
    """An HF size (SizeDict, dict or a bare int meaning the shortest edge) -> its set int
    entries."""
    if isinstance(size, int) and not isinstance(size, bool):
        return {"shortest_edge": size}
    try:
        items = dict(size or {})
    except (TypeError, ValueError):
        return {}
    return {k: int(v) for k, v in items.items() if isinstance(v, int) and v > 0}


@dataclass(frozen=True)
class ImageLimits:
    """Caps on one image (why: a request must never cost unbounded memory or time)."""

    max_bytes: int = 20 * 2**20  # encoded size, after base64 decoding
    max_pixels: int = 4096 * 4096  # width * height, checked before decoding the pixels
    max_images: int = 8  # images in one prompt (--limit-images-per-prompt)
    max_aspect_ratio: float = GatewayConfig.max_image_aspect_ratio  # longest / shortest side
    resize: ResizeRule | None = None  # the model's processor: its planned size is bounded too
    max_planned_pixels: int = MAX_PLANNED_PIXELS  # of the image `resize` plans

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_pixels, self.max_images, self.max_planned_pixels) < 1:
            raise ValueError("image limits must be positive")
        if self.max_aspect_ratio < 1:
            raise ValueError("max_aspect_ratio must be >= 1")

    def check_size(self, width: int, height: int) -> None:
        """InvalidRequest unless a `width` x `height` image is within every cap; called with
        the header's size, before anything is decoded or resized."""
        if width * height > self.max_pixels:
            raise InvalidRequest(
                f"image is {width}x{height} pixels, over the {self.max_pixels} pixel limit"
            )
        if max(width, height) > self.max_aspect_ratio * max(min(width, height), 1):
            raise InvalidRequest(
                f"image is {width}x{height} pixels, an aspect ratio over the "
                f"{self.max_aspect_ratio:g}:1 limit"
            )
        planned = self.resize.planned_pixels(width, height) if self.resize else 0
        if planned > self.max_planned_pixels:
            raise InvalidRequest(
                f"image is {width}x{height} pixels; the model's processor would resize it to "
                f"{planned} pixels, over the {self.max_planned_pixels} pixel limit"
            )


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """Encoded PNG/JPEG/WebP bytes -> an RGB image; InvalidRequest for anything else."""
    if len(data) > limits.max_bytes:
        raise InvalidRequest(f"image is {len(data)} bytes, over the {limits.max_bytes} limit")
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
        limits.check_size(*image.size)
        return image.convert("RGB")
    except (OSError, Image.DecompressionBombError, SyntaxError, ValueError) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(f"image_url does not hold a PNG, JPEG or WebP image ({exc})") from None


def decode_data_url(url: str, limits: ImageLimits) -> Image.Image:
    """A `data:image/...;base64,` URL -> an RGB image (InvalidRequest when malformed)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise InvalidRequest("image_url must be a data:image/...;base64, URL", "image_url")
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise InvalidRequest(f"image is over the {limits.max_bytes}-byte limit", "image_url")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("image_url holds invalid base64", "image_url") from None
    return decode_image(data, limits)


def image_hash(image: Image.Image) -> str:
    """Content hash of an image's pixels (mode, size, bytes): equal images hash equal."""
    h = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


@dataclass
class PreparedImages:
    """A prompt with its images: token ids, mm_inputs, and the exports to close."""

    token_ids: list[int]
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    exports: list[ExportedTensor] = field(default_factory=list)

    def close(self) -> None:
        """Release every exported pixel tensor (unlinks shm segments)."""
        for export in self.exports:
            export.close()


class MultiModalProcessor:
    """The model directory's HF processor and image token."""

    def __init__(self, hf_processor: Any, image_token: str, image_token_id: int) -> None:
        self.hf = hf_processor
        self.image_token = image_token  # the placeholder text the processor expands
        self.image_token_id = image_token_id
        image_processor = getattr(hf_processor, "image_processor", None)
        self.resize_rule = ResizeRule.of(image_processor)
        if not self.resize_rule.known:
            log.warning(
                "cannot read how %s resizes images; only the pixel and aspect-ratio caps "
                "bound what it allocates",
                type(image_processor).__name__,
            )

    @classmethod
    def load(cls, model_dir: Path) -> MultiModalProcessor | None:
        """The processor of a vision-language model directory; None for a text-only model."""
        config = json.loads((model_dir / "config.json").read_text())
        if "vision_config" not in config:
            return None
        from gateway.hf_processor import load_hf_processor

        hf = load_hf_processor(model_dir, config)
        token = str(getattr(hf, "image_token", "<image>"))
        token_id = config.get("image_token_index", config.get("image_token_id"))
        if token_id is None:
            token_id = hf.tokenizer.convert_tokens_to_ids(token)
        return cls(hf, token, int(token_id))

    def prepare(
        self,
        text: str,
        images: Sequence[Image.Image],
        mode: ExportMode = "shm",
        add_special_tokens: bool = True,
        limits: ImageLimits | None = None,
    ) -> PreparedImages:
        """Expand `text` (one image placeholder per image) and export each image's pixels;
        each image's size is checked against `limits` (default caps and this processor's
        resize rule) before the processor runs."""
        if text.count(self.image_token) != len(images):
            raise InvalidRequest(
                f"the prompt has {text.count(self.image_token)} image placeholders "
                f"({self.image_token}) but {len(images)} images"
            )
        limits = limits or ImageLimits(resize=self.resize_rule)
        for image in images:
            limits.check_size(*image.size)
        if not images:
            plain = self.hf.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            return PreparedImages(list(plain))
        out = self.hf(
            text=[text],
            images=list(images),
            return_tensors="pt",
            add_special_tokens=add_special_tokens,
        )
        from services.tensor_handles import export_tensor

        ids: list[int] = out["input_ids"][0].tolist()
        grids = _grids(out)
        patches = [t * h * w for t, h, w in grids] if grids else self._patches(images)
        ranges = self._ranges(ids, patches, self._merge if grids else 1)
        prepared = PreparedImages(ids)
        try:
            for i, (image, pixels, (start, end)) in enumerate(
                zip(images, _per_image(out, patches), ranges, strict=True)
            ):
                export = export_tensor(pixels.contiguous(), mode)
                prepared.exports.append(export)
                grid = list(grids[i]) if grids else []
                prepared.mm_inputs.append(
                    MultiModalInput(
                        "image", start, end - start, image_hash(image), export.handle, grid
                    )
                )
        except BaseException:
            prepared.close()
            raise
        return prepared

    def _patches(self, images: Sequence[Image.Image]) -> list[int]:
        """Tiles (patches) the processor makes of each image: 1 for LLaVA."""
        sizes = [(im.height, im.width) for im in images]
        return list(self.hf._get_num_multimodal_tokens(image_sizes=sizes).num_image_patches)

    @property
    def _merge(self) -> int:
        """Patches per image token of a Qwen2-VL-style processor (merge_size ** 2)."""
        return int(getattr(self.hf.image_processor, "merge_size", 1)) ** 2

    def _ranges(self, ids: list[int], patches: list[int], merge: int = 1) -> list[tuple[int, int]]:
        """[start, end) of each image's image tokens, splitting them by each image's patch
        count (adjacent images may form one run of tokens); `merge` patches make one token
        (Qwen2-VL's 2x2 merging)."""
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        if merge > 1:
            patches = [p // merge for p in patches]
        per_patch, rest = divmod(len(positions), sum(patches))
        if rest or per_patch == 0:
            raise InvalidRequest("the processor's image tokens do not match the images")
        bounds = np.cumsum([0, *(p * per_patch for p in patches)])
        return [
            (int(positions[a]), int(positions[b - 1]) + 1) for a, b in itertools.pairwise(bounds)
        ]


def _grids(out: Any) -> list[tuple[int, int, int]]:
    """Each image's (t, h, w) patch grid (Qwen2-VL's image_grid_thw); [] for other models."""
    grid = out.get("image_grid_thw")
    return [] if grid is None else [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]


def _per_image(out: Any, patches: list[int]) -> list[torch.Tensor]:
    """The processor's pixel values of one prompt split per image: LLaVA [images, 3, H, W]
    -> [3, H, W]; Idefics3 [1, tiles, 3, H, W] (+ pixel_attention_mask [1, tiles, H, W])
    -> [image's tiles, 4, H, W], the mask as a fourth channel; Qwen2-VL [patches, C*T*P*P]
    (all images' patches, flattened) -> [image's t*h*w patches, C*T*P*P]."""
    import torch

    pixels: torch.Tensor = out["pixel_values"]
    if "image_grid_thw" in out:
        if pixels.dim() != 2 or pixels.shape[0] != sum(patches):
            raise InvalidRequest(f"unsupported pixel_values layout {list(pixels.shape)}")
        return list(pixels.split(patches))
    if pixels.dim() == 4 and pixels.shape[0] == len(patches):
        return list(pixels)
    if pixels.dim() != 5 or pixels.shape[:2] != (1, sum(patches)):
        raise InvalidRequest(f"unsupported pixel_values layout {list(pixels.shape)}")
    tiles = pixels[0]  # [tiles, 3, H, W]
    mask = out.get("pixel_attention_mask")
    if mask is not None:
        tiles = torch.cat([tiles, mask[0].unsqueeze(1).to(tiles.dtype)], dim=1)
    return list(tiles.split(patches))


def chat_images(
    messages: Sequence[dict[str, Any]], limits: ImageLimits
) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """OpenAI chat messages -> (messages whose image_url parts became {"type": "image"},
    as HF chat templates expect, and the decoded images in order)."""
    images: list[Image.Image] = []
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                images.append(decode_data_url(_url_of(part), limits))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    if len(images) > limits.max_images:
        raise InvalidRequest(
            f"{len(images)} images in one prompt, over the limit of {limits.max_images}"
        )
    return out, images


def _url_of(part: dict[str, Any]) -> str:
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str):
        raise InvalidRequest("an image_url part needs {'url': str}", "image_url")
    return url
