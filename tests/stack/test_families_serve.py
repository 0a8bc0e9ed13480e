"""Issue 22 through `tessera serve --dtype float32 --max-num-batched-tokens 16` (chunked
prefill) and the official openai client: for each text-only architecture of the registry, a
tiny random checkpoint's greedy completions of 8 token-id prompts x 32 tokens
(`ignore_eos`) equal HF `generate`'s, token for token: compared as text, HF's tokens
detokenized as the server does (the tiny models emit byte tokens whose partial characters
depend on the prompt's last tokens). Sliding-window models see prompts up to 6x their
window."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from benchmarks.stack import start_stack
from gateway.detokenizer import IncrementalDetokenizer
from gateway.tokenizer import Tokenizer
from tests.worker.tiny_dense import NEW_TOKENS
from tests.worker.tiny_families import (
    ALL_FAMILIES,
    family_prompts,
)

pytestmark = pytest.mark.slow


def _detokenized(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text the server's detokenizer makes of `ids`, one per step, after `prompt`."""
    detokenizer = IncrementalDetokenizer(tokenizer, True, prompt)
    for token_id in ids:
        detokenizer.update([token_id])
    detokenizer.flush()
    return detokenizer.text


@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_served_greedy_matches_hf(
    name: str, tiny_family: Callable[[str], tuple[Path, list[list[int]]]]
) -> None:
    path, expected = tiny_family(name)
    stack = start_stack(
        "--model", str(path), "--dtype", "float32", "--max-num-batched-tokens", "16"
    )  # fmt: skip
    tokenizer = Tokenizer.load(path)
    try:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
        model = client.models.list().data[0].id
        for k, (prompt, ids) in enumerate(zip(family_prompts(name), expected, strict=True)):
            reply = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=NEW_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            assert reply.usage is not None and reply.usage.completion_tokens == NEW_TOKENS
            text = _detokenized(tokenizer, prompt, ids)
            assert text and reply.choices[0].text == text, f"prompt {k} ({len(prompt)} tokens)"
    finally:
        tokenizer.close()
        assert stack.stop() == 0, stack.output()[-3000:]
