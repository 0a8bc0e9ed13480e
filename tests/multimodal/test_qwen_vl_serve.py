"""Tiny random Qwen2-VL and Qwen2.5-VL through `tessera serve --dtype float32`, whole and chunked prefill,
driven by the official openai client: greedy chats with images of different sizes equal
HF generate token for token; a burst of image requests, some dropped mid-stream, leaves
no KV block in use."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from benchmarks.stack import Stack, start_stack
from benchmarks.tiny_vlm import png_bytes, sample_image
from tests.multimodal.hf_vlm import hf_chat_prompt, hf_vlm_greedy
from tests.multimodal.test_no_leaks import _one
from tests.multimodal.test_qwen_vl_offline import KINDS
from tests.multimodal.test_vlm_serve import part, text
from tests.multimodal.tiny_qwen_vl import build_tiny_qwen_vl
from tests.stack.test_serve_e2e import wait_idle

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
BUDGETS = {"whole": "2048", "chunked": "12"}

WIDE = (64, 20)  # another size than sample_image's 40x30: another patch grid


def _part(seed: int, size: tuple[int, int]) -> dict[str, Any]:
    data = base64.b64encode(png_bytes(sample_image(seed, size))).decode()
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}


CHATS: list[tuple[list[dict[str, Any]], list[Image.Image]]] = [
    ([{"role": "user", "content": [part(1), text("What is this?")]}], [sample_image(1)]),
    (
        [{"role": "user", "content": [text("Compare"), part(2), text("and"), _part(3, WIDE)]}],
        [sample_image(2), sample_image(3, WIDE)],
    ),
    (
        [
            {"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": [text("Look at this:"), part(4)]},
        ],
        [sample_image(4)],
    ),
    ([{"role": "user", "content": "No picture this time."}], []),
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
def stack(request: pytest.FixtureRequest, qwen_dir: Path) -> Iterator[Stack]:
    budget = BUDGETS[request.param]
    stack = start_stack(
        "--model", str(qwen_dir), "--dtype", "float32", "--max-num-batched-tokens", budget
    )
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def _client(stack: Stack) -> Any:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_chat_equals_hf_generate(stack: Stack, qwen_dir: Path, index: int) -> None:
    messages, images = CHATS[index]
    prompt = hf_chat_prompt(qwen_dir, messages)
    expected = hf_vlm_greedy(qwen_dir, prompt, images, MAX_TOKENS, add_special_tokens=False)
    client = _client(stack)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    from transformers import AutoTokenizer

    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    assert tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected]
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_dropped_streams_leave_no_block(stack: Stack) -> None:
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            done: list[int] = []
            return list(await asyncio.gather(*(_one(client, model, i, done) for i in range(20))))

    results = asyncio.run(run())
    assert results.count("dropped") == 6 and results.count("ok") == 14, results
    stats = wait_idle(stack, 30)
    assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
