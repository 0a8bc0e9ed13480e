"""Tiny random Qwen2-VL and Qwen2.5-VL (windowed vision attention) through the offline
LLM: dynamic resolution (images of different sizes get different patch grids), M-RoPE
positions, whole and chunked prefill, prefix
caching keyed on the image, and preemption with recompute: greedy tokens equal HF
generate's, and no KV block is left in use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from benchmarks.tiny_vlm import sample_image
from services.types import SamplingParams
from tests.multimodal.conftest import offline_llm
from tests.multimodal.hf_vlm import hf_chat_prompt, hf_vlm_greedy
from tests.multimodal.test_vlm_offline import _image_part
from tests.multimodal.tiny_qwen_vl import IMAGE, MAX_PIXELS, build_tiny_qwen_vl, to_flat_layout

MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BUDGETS = {"whole": 2048, "chunked": 10}  # chunked: an image's 9..20 tokens span steps
KINDS = ["qwen2_vl", "qwen2_5_vl"]
BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # block 16 x layers x (k, v) x kv heads x head_dim x f32

PROMPTS: list[tuple[str, list[Image.Image]]] = [
    (f"Hi {IMAGE} what is it?", [sample_image(1)]),  # 40x30: an 8x10 patch grid
    (f"Compare {IMAGE} with {IMAGE} ok", [sample_image(4), sample_image(5, (64, 20))]),
    (f"A small one {IMAGE}", [sample_image(6, (20, 20))]),  # up to min_pixels: 6x6
    (f"{IMAGE} a large one, scaled down", [sample_image(7, (120, 90))]),  # to max_pixels
    ("Just text, no image here", []),
]


@pytest.fixture(scope="module", params=KINDS)
def qwen_dir(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    return build_tiny_qwen_vl(out, default_model_dir, request.param)


@pytest.fixture(scope="module", params=list(BUDGETS))
def llm(request: pytest.FixtureRequest, qwen_dir: Path) -> Iterator[Any]:
    yield from offline_llm(qwen_dir, BUDGETS[request.param])


def _requests(prompts: list[tuple[str, list[Image.Image]]]) -> list[Any]:
    return [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in prompts]


def _expected(model_dir: Path, prompts: list[tuple[str, list[Image.Image]]]) -> list[list[int]]:
    return [hf_vlm_greedy(model_dir, t, im, MAX_TOKENS) for t, im in prompts]


def test_images_of_different_sizes_get_different_grids(qwen_dir: Path) -> None:
    from gateway.multimodal import MultiModalProcessor

    processor = MultiModalProcessor.load(qwen_dir)
    assert processor is not None
    assert processor.resize_rule.max_pixels == MAX_PIXELS  # the gateway's size bound
    text, images = PROMPTS[1]
    prepared = processor.prepare(text, images, mode="inline")
    try:
        grids = [item.grid_thw for item in prepared.mm_inputs]
        assert grids == [[1, 8, 10], [1, 4, 16]]
        assert [item.length for item in prepared.mm_inputs] == [20, 16]  # t*h*w / 2^2
        pad = processor.image_token_id
        for item in prepared.mm_inputs:
            span = prepared.token_ids[item.offset : item.offset + item.length]
            assert span == [pad] * item.length
    finally:
        prepared.close()


def test_generate_with_images_matches_hf(llm: Any, qwen_dir: Path) -> None:
    outs = llm.generate(_requests(PROMPTS), PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == _expected(qwen_dir, PROMPTS)


def test_chat_with_images_matches_hf(llm: Any, qwen_dir: Path) -> None:
    chats: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": [_image_part(1), {"type": "text", "text": "What?"}]}],
        [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, _image_part(2)]},
        ],
    ]
    outs = llm.chat(chats, PARAMS)
    for chat, seed, out in zip(chats, (1, 2), outs, strict=True):
        text = hf_chat_prompt(qwen_dir, chat)
        expected = hf_vlm_greedy(
            qwen_dir, text, [sample_image(seed)], MAX_TOKENS, add_special_tokens=False
        )
        assert out.outputs[0].token_ids == expected


def test_prefix_cache_hit_keeps_positions(qwen_dir: Path) -> None:
    """The same image twice: the second run reuses blocks past the image (M-RoPE delta and
    all) and still equals HF; a different image with the same text reuses nothing past
    the text before it."""
    llm = next(offline_llm(qwen_dir, 2048))
    try:
        text = f"Look {IMAGE} and tell me everything you can about the picture please"
        first = [(text, [sample_image(8)])]
        other = [(text, [sample_image(9)])]
        assert [o.outputs[0].token_ids for o in llm.generate(_requests(first), PARAMS)] == (
            _expected(qwen_dir, first)
        )
        hits = llm.engine.stats().prefix_cache_hits
        outs = llm.generate(_requests(first + other), PARAMS)
        assert llm.engine.stats().prefix_cache_hits - hits >= 16  # a block past the image
        assert [o.outputs[0].token_ids for o in outs] == _expected(qwen_dir, first + other)
    finally:
        llm.shutdown()


def test_preemption_recomputes_and_frees_every_block(qwen_dir: Path) -> None:
    """Eight image prompts in a KV pool too small for all of them: requests are preempted
    and recomputed (positions and images again), outputs still equal HF, no block leaks."""
    from tessera import LLM

    prompts = [(f"Picture {i}: {IMAGE} describe", [sample_image(20 + i)]) for i in range(8)]
    llm = LLM(
        str(qwen_dir),
        dtype="float32",
        kv_cache_memory=8 * BLOCK_BYTES,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    try:
        outs = llm.generate(_requests(prompts), PARAMS)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_used == 0 and stats.num_running == 0
    assert [o.outputs[0].token_ids for o in outs] == _expected(qwen_dir, prompts)


def test_image_changes_the_output(llm: Any) -> None:
    outs = llm.generate(_requests([(f"{IMAGE} what?", [sample_image(s)]) for s in (6, 7)]), PARAMS)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_flat_hub_layout_loads_the_same_model(qwen_dir: Path, tmp_path: Path) -> None:
    """The Hub's older layout (flat config, rope_scaling type "mrope", model.layers.* and
    visual.* tensors) serves the same model."""
    flat = to_flat_layout(qwen_dir, tmp_path / "flat")
    llm = next(offline_llm(flat, 2048))
    try:
        outs = llm.generate(_requests(PROMPTS[:2]), PARAMS)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == _expected(qwen_dir, PROMPTS[:2])
