"""Images of a chat request in the gateway: fetch or decode each image_url part, run the
model's processor, export the pixels as tensor handles (shm when the worker shares this
host, inline bytes otherwise).

Remote http(s) URLs go through a `MediaFetcher` (gateway.fetch): refused unless their host
is in `allowed_media_domains` and resolves to public addresses only, one deadline for the
whole fetch, a byte cap, no redirects. Every image's size is checked from its header,
against the caps and the processor's planned resize, before it is decoded.
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from gateway.errors import InvalidRequest
from gateway.fetch import MediaFetcher
from gateway.multimodal import (
    ImageLimits,
    MultiModalProcessor,
    PreparedImages,
    decode_data_url,
    decode_image,
)
from gateway.protocol import ChatMessage
from gateway.tokenizer import Tokenizer
from services.config import GatewayConfig

if TYPE_CHECKING:
    from services.tensor_handles import ExportMode


@dataclass
class ImageService:
    """The served VLM's processor plus the gateway's media rules."""

    processor: MultiModalProcessor
    limits: ImageLimits  # with the processor's resize rule
    fetcher: MediaFetcher = field(default_factory=MediaFetcher)  # default: no remote URLs
    transport: str = "auto"  # "auto", "shm" or "inline" (GatewayConfig.image_transport)

    @classmethod
    def load(cls, config: GatewayConfig, model_dir: Path) -> ImageService | None:
        """None for a text-only model."""
        processor = MultiModalProcessor.load(model_dir)
        if processor is None:
            return None
        limits = ImageLimits(
            config.max_image_bytes,
            config.max_image_pixels,
            config.limit_images_per_prompt,
            config.max_image_aspect_ratio,
            processor.resize_rule,
        )
        fetcher = MediaFetcher(
            config.allowed_media_domains,
            config.allowed_media_networks,
            config.media_fetch_timeout_s,
            config.max_image_bytes,
        )
        return cls(processor, limits, fetcher, config.image_transport)

    async def prepare_chat(
        self,
        messages: Sequence[ChatMessage],
        turns: list[dict[str, Any]],
        tokenizer: Tokenizer,
        worker_host_id: str,
        template_kwargs: dict[str, Any] | None = None,
    ) -> PreparedImages:
        """Render `turns` (image parts in place), then expand and export."""
        images = [await self._load(url, tokenizer) for url in _image_urls(messages)]
        render = functools.partial(tokenizer.render_chat, template_kwargs=template_kwargs)
        text = await tokenizer.run(render, turns)
        mode = self._mode(worker_host_id)
        return await tokenizer.run(self.processor.prepare, text, images, mode, False, self.limits)

    def _mode(self, worker_host_id: str) -> ExportMode:
        from services.tensor_handles import host_id

        if self.transport in ("shm", "inline"):
            return "shm" if self.transport == "shm" else "inline"
        return "shm" if worker_host_id and worker_host_id == host_id() else "inline"

    async def _load(self, url: str, tokenizer: Tokenizer) -> Image.Image:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return await tokenizer.run(decode_data_url, url, self.limits)
        if scheme not in ("http", "https"):
            raise InvalidRequest("image_url must be a data: or http(s) URL", "messages")
        data = await self.fetcher.fetch(url)
        return await tokenizer.run(decode_image, data, self.limits)


async def prepare_chat_images(
    service: ImageService | None,
    model_name: str,
    messages: Sequence[ChatMessage],
    turns: list[dict[str, Any]],
    tokenizer: Tokenizer,
    worker_host_id: str,
    template_kwargs: dict[str, Any] | None = None,
) -> PreparedImages:
    """`service.prepare_chat`, or 400 when the served model takes no (or fewer) images."""
    check_image_count(service, model_name, len(_image_urls(messages)))
    assert service is not None  # a prompt with images, and check_image_count let it through
    return await service.prepare_chat(messages, turns, tokenizer, worker_host_id, template_kwargs)


def check_image_count(service: ImageService | None, model_name: str, count: int) -> None:
    """400 for `count` images in one prompt: any for a text-only model, else more than
    --limit-images-per-prompt. REST and gRPC call it before any image is converted."""
    if count and service is None:
        raise InvalidRequest(
            f"'{model_name}' is a text-only model; image_url content parts are not supported",
            "messages",
        )
    if service is not None and count > service.limits.max_images:
        raise InvalidRequest(
            f"{count} images in one prompt, over the limit of {service.limits.max_images}",
            "messages",
        )


def _image_urls(messages: Sequence[ChatMessage]) -> list[str]:
    return [
        p.image_url.url
        for m in messages
        if isinstance(m.content, list)
        for p in m.content
        if p.type == "image_url" and p.image_url is not None
    ]


def _is_image(part: Any) -> bool:
    return getattr(part, "type", None) == "image_url" and part.image_url is not None
