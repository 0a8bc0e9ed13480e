"""`tessera serve --model FILE.gguf` (the default model's Q4_1 file as shipped): chat and
completions over the official openai client equal HF generate over the same file
dequantized to float32 (which is the default model's converted directory), token for
token; a bad GGUF stops `tessera serve` with the file named, before anything serves."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from benchmarks.stack import Stack, start_stack
from services.default_model import gguf_path
from tests.conftest import free_port
from tests.hf_reference import hf_greedy
from tests.quant.gguf_files import truncated
from tests.quant.test_gguf import PROMPTS

pytestmark = pytest.mark.slow
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = start_stack("--model", str(gguf_path()), "--dtype", "float32")
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def test_served_gguf_greedy_equals_hf(stack: Stack, default_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    expected = hf_greedy(default_model_dir, prompts, NEW_TOKENS)
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    for prompt, ids in zip(PROMPTS[:4], expected, strict=True):
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0.0,
    )  # fmt: skip
    assert "Paris" in (chat.choices[0].message.content or "")


def test_a_bad_gguf_stops_serve_naming_the_file(tmp_path: Path) -> None:
    bad = truncated(tmp_path / "cut.gguf")
    run = subprocess.run(
        [sys.executable, "-m", "tessera", "serve", "--model", str(bad), "--port", "0",
         "--grpc-port", "0", "--worker-port", str(free_port()),
         "--scheduler-port", str(free_port())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode != 0 and f"{bad}: not a readable GGUF file" in output
    assert "SERVING" not in output
