"""Tiny random LLaVA through the offline LLM: greedy tokens equal HF generate's."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from services.types import SamplingParams
from tests.multimodal.hf_vlm import hf_vlm_greedy
from tests.multimodal.tiny_vlm import png_bytes, sample_image

MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(sample_image(seed))).decode()


def _image_part(seed: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": _data_url(seed)}}


CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": [_image_part(1), {"type": "text", "text": "What is this?"}]}],
    [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, _image_part(2)]},
    ],
]


@pytest.fixture(scope="module", params=[2048, 20], ids=["whole", "chunked"])
def llm(request: pytest.FixtureRequest, tiny_llava_dir: Path) -> Any:
    from tessera import LLM

    engine = LLM(
        str(tiny_llava_dir),
        dtype="float32",
        kv_cache_memory="32MiB",
        max_num_batched_tokens=request.param,
        max_num_seqs=8,
    )
    yield engine
    engine.shutdown()


def test_generate_with_images_matches_hf(llm: Any, tiny_llava_dir: Path) -> None:
    prompts = [
        ("USER: <image>\nDescribe it. ASSISTANT:", [sample_image(3)]),
        ("Compare <image> with <image> please", [sample_image(4), sample_image(5, (64, 20))]),
        ("Just text, no image here", []),
    ]
    outs = llm.generate(
        [
            {"prompt": text, "multi_modal_data": {"image": images}} if images else text
            for text, images in prompts
        ],
        PARAMS,
    )
    for (text, images), out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_vlm_greedy(tiny_llava_dir, text, images, MAX_TOKENS)


def hf_chat_prompt(model_dir: Path, chat: list[dict[str, Any]]) -> str:
    """The chat rendered by the model's own processor, image_url parts as {"type": "image"}."""
    from transformers import AutoProcessor

    turns = [
        {
            **m,
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        if isinstance(m["content"], list)
        else m
        for m in chat
    ]
    processor = AutoProcessor.from_pretrained(model_dir)
    return str(processor.apply_chat_template(turns, add_generation_prompt=True))


def test_chat_with_images_matches_hf(llm: Any, tiny_llava_dir: Path) -> None:
    outs = llm.chat(CHATS, PARAMS)
    images = [[sample_image(1)], [sample_image(2)]]
    for chat, pil, out in zip(CHATS, images, outs, strict=True):
        text = hf_chat_prompt(tiny_llava_dir, chat)
        expected = hf_vlm_greedy(tiny_llava_dir, text, pil, MAX_TOKENS, add_special_tokens=False)
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
