"""Issue 22, MoE through `tessera serve --model DIR --dtype float32` (chunked prefill: a
16-token budget) with the official openai client: each tiny random MoE's greedy completions
of 8 token-id prompts x 32 tokens equal HF generate's, token for token (compared as text
decoded by the same tokenizer)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.hf_reference import hf_greedy
from tests.stack.harness import start_stack
from tests.worker.test_moe_models import NEW_TOKENS, PROMPTS
from tests.worker.tiny_moe import ARCHITECTURES, save_tiny_moe

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_serve_moe_greedy_equals_hf(kind: str, tmp_path: Path, default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    path = save_tiny_moe(kind, tmp_path / kind, default_model_dir)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    tok = AutoTokenizer.from_pretrained(str(path))
    stack = start_stack(
        "--model", str(path), "--dtype", "float32", "--max-num-batched-tokens", "16"
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        for prompt, want in zip(PROMPTS, expected, strict=True):
            reply = client.completions.create(
                model=model,
                prompt=prompt,
                temperature=0,
                max_tokens=NEW_TOKENS,
                extra_body={"ignore_eos": True},
            )
            assert reply.usage is not None and reply.usage.completion_tokens == NEW_TOKENS
            assert reply.choices[0].text == tok.decode(want, skip_special_tokens=True)
    finally:
        stack.stop()
