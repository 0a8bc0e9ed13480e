"""Tiny random LLaVA and Idefics3 (SmolVLM layout: tiled images, pixel-shuffle connector)
through the offline LLM, whole and chunked prefill: greedy tokens equal HF generate's."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tiny_vlm import png_bytes, sample_image
from services.types import SamplingParams
from tests.multimodal.conftest import offline_llm
from tests.multimodal.hf_vlm import hf_chat_prompt, hf_vlm_greedy

MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BUDGETS = {"whole": 2048, "chunked": 20}  # step token budgets: whole / split prefill


def _image_part(seed: int) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(sample_image(seed))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": [_image_part(1), {"type": "text", "text": "What is this?"}]}],
    [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, _image_part(2)]},
    ],
]
PROMPTS = [
    ("User:<image>Describe it.\nAssistant:", [sample_image(3)]),  # Idefics3: 2x2 tiles + global
    ("Compare <image> with <image> please", [sample_image(4), sample_image(5, (64, 20))]),
    ("A small one <image>", [sample_image(6, (20, 20))]),
    ("Just text, no image here", []),
]


@pytest.fixture(scope="module", params=list(BUDGETS))
def llm(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Any]:
    yield from offline_llm(model_dir, BUDGETS[request.param])


def test_generate_with_images_matches_hf(llm: Any, model_dir: Path) -> None:
    outs = llm.generate(
        [
            {"prompt": text, "multi_modal_data": {"image": images}} if images else text
            for text, images in PROMPTS
        ],
        PARAMS,
    )
    for (text, images), out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_vlm_greedy(model_dir, text, images, MAX_TOKENS)


def test_chat_with_images_matches_hf(llm: Any, model_dir: Path) -> None:
    outs = llm.chat(CHATS, PARAMS)
    images = [[sample_image(1)], [sample_image(2)]]
    for chat, pil, out in zip(CHATS, images, outs, strict=True):
        text = hf_chat_prompt(model_dir, chat)
        expected = hf_vlm_greedy(model_dir, text, pil, MAX_TOKENS, add_special_tokens=False)
        assert out.outputs[0].token_ids == expected


def test_image_changes_the_output(llm: Any) -> None:
    """The encoder really feeds the LM: two different images, different continuations."""
    outs = llm.generate(
        [
            {"prompt": "<image> what?", "multi_modal_data": {"image": sample_image(s)}}
            for s in (6, 7)
        ],
        PARAMS,
    )
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
