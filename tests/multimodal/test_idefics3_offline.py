"""Tiny random Idefics3 (SmolVLM layout: tiled images, pixel-shuffle connector) through
the offline LLM: greedy tokens equal HF generate's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.types import SamplingParams
from tests.multimodal.hf_vlm import hf_vlm_greedy
from tests.multimodal.test_llava_offline import CHATS, hf_chat_prompt
from tests.multimodal.tiny_vlm import build_tiny_idefics3, sample_image

MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("idefics3"), default_model_dir)


@pytest.fixture(scope="module", params=[2048, 20], ids=["whole", "chunked"])
def llm(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Any]:
    from tessera import LLM

    engine = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_memory="32MiB",
        max_num_batched_tokens=request.param,
        max_num_seqs=8,
    )
    yield engine
    engine.shutdown()


def test_generate_with_images_matches_hf(llm: Any, model_dir: Path) -> None:
    prompts = [
        ("User:<image>Describe it.\nAssistant:", [sample_image(3)]),  # 2x2 tiles + global
        ("Compare <image> with <image> please", [sample_image(4), sample_image(5, (64, 20))]),
        ("A small one <image>", [sample_image(6, (20, 20))]),
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
        assert out.outputs[0].token_ids == hf_vlm_greedy(model_dir, text, images, MAX_TOKENS)


def test_chat_with_images_matches_hf(llm: Any, model_dir: Path) -> None:
    outs = llm.chat(CHATS, PARAMS)
    images = [[sample_image(1)], [sample_image(2)]]
    for chat, pil, out in zip(CHATS, images, outs, strict=True):
        text = hf_chat_prompt(model_dir, chat)
        expected = hf_vlm_greedy(model_dir, text, pil, MAX_TOKENS, add_special_tokens=False)
        assert out.outputs[0].token_ids == expected
