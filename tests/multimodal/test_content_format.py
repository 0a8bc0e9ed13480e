"""Chat templates that walk content parts (LLaVA's and Idefics3's own templates) get every
message as parts, as HF's processors are given them: multi-turn image chats through
`tessera serve` equal HF's processor token for token, whether the earlier turns are parts or
strings, with or without a system message (`--chat-template-content-format auto`)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from benchmarks.stack import Stack, start_stack
from benchmarks.tiny_vlm import (
    BUILDERS,
    CHAT_TEMPLATE,
    png_bytes,
    sample_image,
)
from gateway.chat_format import detect_content_format
from tests.multimodal.hf_vlm import _hf, hf_vlm_greedy

# The templates llava-hf/llava-1.5 and HuggingFaceM4/Idefics3 ship (content parts only).
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TEMPLATES = {"llava": LLAVA_TEMPLATE, "idefics3": IDEFICS3_TEMPLATE}
MAX_TOKENS = 8


def _image(seed: int) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(sample_image(seed))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


LAST = {"role": "user", "content": [_image(7), _text("Describe it.")]}
CHATS: dict[str, list[dict[str, Any]]] = {
    "parts": [
        {"role": "user", "content": [_text("Hello")]},
        {"role": "assistant", "content": [_text("Hi there.")]},
        LAST,
    ],
    "strings": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."},
        LAST,
    ],
    "system": [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [_text("Hi there.")]},
        LAST,
    ],
}


def test_templates_that_walk_parts_take_parts() -> None:
    assert detect_content_format(LLAVA_TEMPLATE) == "openai"
    assert detect_content_format(IDEFICS3_TEMPLATE) == "openai"
    assert detect_content_format(CHAT_TEMPLATE) == "openai"
    assert detect_content_format("{{ message['content'] }}") == "string"
    assert detect_content_format(LLAVA_TEMPLATE, "string") == "string"


def hf_reference(model_dir: Path, chat: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) by HF's processor on the chat as parts, strings becoming one
    text part (what these templates are written for)."""
    turns = [
        {
            **m,
            "content": [_text(m["content"])]
            if isinstance(m["content"], str)
            else [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        for m in chat
    ]
    processor = _hf(model_dir)[1]
    prompt = str(processor.apply_chat_template(turns, add_generation_prompt=True))
    image = [sample_image(7)]
    ids = processor(text=[prompt], images=image, add_special_tokens=False)["input_ids"][0]
    greedy = hf_vlm_greedy(model_dir, prompt, image, MAX_TOKENS, add_special_tokens=False)
    return list(ids), greedy


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> Iterator[tuple[Path, Stack]]:
    build, template = BUILDERS[request.param], TEMPLATES[request.param]
    model_dir = build(
        tmp_path_factory.mktemp(request.param), default_model_dir, chat_template=template
    )
    stack = start_stack("--model", str(model_dir), "--dtype", "float32")
    yield model_dir, stack
    assert stack.stop() == 0, stack.output()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("form", list(CHATS))
def test_multi_turn_image_chat_equals_hf(served: tuple[Path, Stack], form: str) -> None:
    from transformers import AutoTokenizer

    model_dir, stack = served
    prompt_ids, expected = hf_reference(model_dir, CHATS[form])
    client: Any = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=CHATS[form], temperature=0,
        max_tokens=MAX_TOKENS, logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.usage.prompt_tokens == len(prompt_ids)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    assert tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected]
