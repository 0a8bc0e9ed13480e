"""Acceptance 1 and 2 over HTTP: `tessera serve --model <tiny LLaVA | tiny Idefics3>
--dtype float32`,
driven by the official openai client. Greedy output equals HF generate on the same inputs;
a repeated image request hits the prefix cache past the image, a different image does not."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from benchmarks.stack import REPO, Stack, start_stack
from benchmarks.tiny_vlm import png_bytes, sample_image
from tests.multimodal.hf_vlm import hf_chat_prompt, hf_vlm_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
LONG_TEXT = " ".join(f"Question {i}: what colour is the square in row {i}?" for i in range(6))


def part(seed: int) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(sample_image(seed))).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


CHATS: list[tuple[list[dict[str, Any]], list[int]]] = [
    ([{"role": "user", "content": [part(1), text("What is this?")]}], [1]),
    ([{"role": "user", "content": [text("Compare"), part(2), text("and"), part(3)]}], [2, 3]),
    (
        [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": [text("Look at this:"), part(4)]},
        ],
        [4],
    ),
    ([{"role": "user", "content": [part(5), text(LONG_TEXT)]}], [5]),
    ([{"role": "user", "content": "No picture this time."}], []),
]


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[Stack]:
    stack = start_stack(
        "--model", str(model_dir), "--dtype", "float32", "--max-num-batched-tokens", "24"
    )
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def _client(stack: Stack) -> Any:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")


def _ask(
    stack: Stack, messages: list[dict[str, Any]], stream: bool = False, logprobs: bool = False
) -> Any:
    return _client(stack).chat.completions.create(
        model=_client(stack).models.list().data[0].id,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=stream,
        logprobs=logprobs,
        extra_body={"ignore_eos": True},
    )


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_chat_equals_hf_generate(stack: Stack, model_dir: Path, index: int) -> None:
    from transformers import AutoTokenizer

    messages, seeds = CHATS[index]
    expected_ids = hf_vlm_greedy(
        model_dir,
        hf_chat_prompt(model_dir, messages),
        [sample_image(s) for s in seeds],
        MAX_TOKENS,
        add_special_tokens=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    reply = _ask(stack, messages, logprobs=True)
    assert reply.choices[0].message.content == expected
    # token for token: each sampled token as the gateway reports it (decoded on its own)
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    assert tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected_ids]
    streamed = "".join(c.choices[0].delta.content or "" for c in _ask(stack, messages, True))
    assert streamed == expected


def _image_span(model_dir: Path, messages: list[dict[str, Any]], seed: int) -> tuple[int, int]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    ids = processor(
        text=[hf_chat_prompt(model_dir, messages)],
        images=[sample_image(seed)],
        add_special_tokens=False,
    )["input_ids"][0]
    where = [i for i, t in enumerate(ids) if t == processor.image_token_id]
    return where[0], where[-1] + 1


def test_prefix_cache_keys_on_the_image(stack: Stack, model_dir: Path) -> None:
    def ask(seed: int) -> tuple[list[dict[str, Any]], int]:
        messages = [{"role": "user", "content": [part(seed), text("Repeat: " + LONG_TEXT)]}]
        usage = _ask(stack, messages).usage
        return messages, usage.prompt_tokens_details.cached_tokens

    messages, _ = ask(11)
    _, cached_again = ask(11)
    image_start, image_end = _image_span(model_dir, messages, 11)
    assert cached_again > image_end  # the same image + text: cached beyond the image
    _, cached_other = ask(12)
    assert cached_other <= image_start  # a different image: nothing from the image on


@pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="needs node"
)
def test_node_client_sends_an_image(stack: Stack, tmp_path: Path) -> None:
    client_dir = REPO / "examples" / "clients" / "node"
    if not (client_dir / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--no-package-lock"],
            cwd=client_dir, check=True, timeout=300,
        )  # fmt: skip
    image = tmp_path / "picture.png"
    image.write_bytes(png_bytes(sample_image(8)))
    prompt = "Describe the picture."
    done = subprocess.run(
        ["node", "client.js", "--gateway", stack.gateway_grpc_address, "--scheduler",
         stack.scheduler_address, "--prompt", prompt, "--image", str(image),
         "--max-tokens", str(MAX_TOKENS)],
        cwd=client_dir, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "TESSERA_INTERNAL_TOKEN": stack.internal_token},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])["answer"]
    same = _client(stack).chat.completions.create(
        model=_client(stack).models.list().data[0].id,
        messages=[{"role": "user", "content": [text(prompt), part(8)]}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert answer == same.choices[0].message.content
