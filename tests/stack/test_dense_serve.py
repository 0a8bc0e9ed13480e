"""`tessera serve` on a tiny random Phi-3 with longrope and a 20-token sliding window on
every layer (issue 22): greedy completions over the openai client equal HF generate, with
prefill chunked by a small --max-num-batched-tokens and out-of-window blocks freed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.stack.harness import Stack, start_stack
from tests.worker.test_dense_families import FAMILIES
from tests.worker.tiny_dense import eight_prompts, hf_reference, save_tiny

pytestmark = pytest.mark.slow

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    _, overrides = FAMILIES["phi3"]
    path = save_tiny("phi3", tmp_path_factory.mktemp("phi3"), **overrides, sliding_window=20)
    for name in TOKENIZER_FILES:  # ids < 320 are real tokens of the default model's tokenizer
        shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def stack(tiny_phi3: Path) -> Iterator[Stack]:
    stack = start_stack(
        "--model", str(tiny_phi3), "--dtype", "float32", "--max-num-batched-tokens", "16"
    )
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def test_served_greedy_matches_hf(stack: Stack, tiny_phi3: Path) -> None:
    prompts = [eight_prompts()[k] for k in (4, 7)]  # 47 and 100 tokens: past window and 32
    expected = hf_reference(tiny_phi3, prompts)
    tokenizer = AutoTokenizer.from_pretrained(tiny_phi3)
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    for prompt, ids in zip(prompts, expected, strict=True):
        reply = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=len(ids),
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == len(ids)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert text and reply.choices[0].text == text
