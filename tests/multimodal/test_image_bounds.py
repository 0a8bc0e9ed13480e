"""What a model's image processor would allocate is bounded before it runs (issue 25, finding
2): the resize rule read from each processor's config, and the refusals of ImageLimits and
MultiModalProcessor.prepare for images the processor would blow up."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from benchmarks.tiny_vlm import png_bytes, sample_image
from gateway.errors import InvalidRequest
from gateway.multimodal import ImageLimits, MultiModalProcessor, ResizeRule, decode_image

WIDE = (400000, 1)


def test_llava_shortest_edge_rule(tiny_llava_dir: Path) -> None:
    rule = MultiModalProcessor.load(tiny_llava_dir).resize_rule  # type: ignore[union-attr]
    assert rule == ResizeRule(shortest_edge=32) and rule.known
    assert rule.planned_pixels(*WIDE) == 32 * 12_800_000  # what HF asked for before the fix
    assert rule.planned_pixels(40, 30) == 43 * 32


def test_hf_processor_rules() -> None:
    from transformers import CLIPImageProcessor, Idefics3ImageProcessor, Qwen2VLImageProcessor

    llava15 = ResizeRule.of(CLIPImageProcessor(size={"shortest_edge": 336}))
    assert llava15.planned_pixels(4096, 2048) == 672 * 336
    assert llava15.planned_pixels(200 * 336, 336) == 200 * 336 * 336  # over 16.7 Mpx: refused
    smolvlm = ResizeRule.of(
        Idefics3ImageProcessor(size={"longest_edge": 1456}, max_image_size={"longest_edge": 364})
    )
    assert smolvlm == ResizeRule(longest_edge=1456, tile=364)
    assert smolvlm.planned_pixels(*WIDE) == 1456 * 364 + 364**2  # one row of tiles
    assert smolvlm.planned_pixels(4096, 4096) == 1456 * 1456 + 364**2
    qwen = ResizeRule.of(Qwen2VLImageProcessor())  # size edges are pixel counts there
    assert qwen.max_pixels == 28 * 28 * 1280 and qwen.planned_pixels(*WIDE) == 28 * 28 * 1280


def test_generic_rules() -> None:
    fixed = ResizeRule.of(SimpleNamespace(size={"height": 224, "width": 224}))
    assert fixed.planned_pixels(*WIDE) == 224 * 224
    fit = ResizeRule.of(SimpleNamespace(size={"max_height": 100, "max_width": 200}))
    assert fit.planned_pixels(1000, 1000) == 100 * 100
    capped = ResizeRule.of(SimpleNamespace(size={"shortest_edge": 800, "longest_edge": 1333}))
    assert capped.planned_pixels(*WIDE) == 1333 * 1  # DETR-style: the long side capped
    bare = ResizeRule.of(SimpleNamespace(size=336))
    assert bare == ResizeRule(shortest_edge=336)
    off = ResizeRule.of(SimpleNamespace(size={"shortest_edge": 336}, do_resize=False))
    assert off.known and off.planned_pixels(*WIDE) == 400000
    unknown = ResizeRule.of(object())
    assert not unknown.known and unknown.planned_pixels(640, 480) == 640 * 480


def test_limits_refuse_from_the_header() -> None:
    llava = ResizeRule(shortest_edge=32)
    with pytest.raises(InvalidRequest, match="aspect ratio over the 200:1 limit"):
        ImageLimits(resize=llava).check_size(*WIDE)
    with pytest.raises(InvalidRequest, match="aspect ratio over the 5:1 limit"):
        ImageLimits(max_aspect_ratio=5).check_size(1, 6)
    # with the aspect-ratio cap off, the planned size still refuses it
    with pytest.raises(InvalidRequest, match="would resize it to 409600000 pixels"):
        ImageLimits(max_aspect_ratio=1e9, resize=llava).check_size(*WIDE)
    ImageLimits(resize=llava).check_size(200, 1)  # 200:1 is allowed
    with pytest.raises(ValueError, match="aspect"):
        ImageLimits(max_aspect_ratio=0.5)


def test_decode_refuses_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[tuple[int, int]] = []
    real_convert = Image.Image.convert

    def convert(self: Image.Image, *args: Any, **kwargs: Any) -> Image.Image:
        decoded.append(self.size)
        return real_convert(self, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "convert", convert)
    png = png_bytes(Image.new("L", WIDE))
    with pytest.raises(InvalidRequest, match="aspect ratio"):
        decode_image(png, ImageLimits())
    assert decoded == []
    assert decode_image(png_bytes(sample_image(1)), ImageLimits()).size == (40, 30)
    assert decoded == [(40, 30)]


class _Spy:
    """An HF processor stand-in that records calls and delegates."""

    def __init__(self, hf: Any) -> None:
        self.hf, self.calls = hf, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.hf(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hf, name)


def test_prepare_refuses_before_the_processor_runs(model_dir: Path) -> None:
    processor = MultiModalProcessor.load(model_dir)
    assert processor is not None
    spy = _Spy(processor.hf)
    processor.hf = spy
    text = f"Look: {processor.image_token}"
    for size in (WIDE, WIDE[::-1]):
        with pytest.raises(InvalidRequest, match="aspect ratio"):
            processor.prepare(text, [Image.new("RGB", size)], "inline")
    assert spy.calls == 0
    processor.prepare(text, [sample_image(1)], "inline").close()
    assert spy.calls == 1


def test_prepare_applies_the_planned_bound(tiny_llava_dir: Path) -> None:
    processor = MultiModalProcessor.load(tiny_llava_dir)
    assert processor is not None
    limits = ImageLimits(max_aspect_ratio=1e9, resize=processor.resize_rule)
    with pytest.raises(InvalidRequest, match="would resize it"):
        processor.prepare(processor.image_token, [Image.new("RGB", WIDE)], "inline", True, limits)
