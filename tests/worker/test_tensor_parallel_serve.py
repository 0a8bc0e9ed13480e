"""Issue 13, acceptance 1: `tessera serve --tensor-parallel-size 2 --dtype float32` with the
real default model gives, through the HTTP stack and the official openai client, the same
greedy tokens as `--tensor-parallel-size 1` and the same text as HF generate on 8 chat
prompts; each rank logs the layer-weight bytes it holds, about half of the TP=1 total."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from benchmarks.stack import Stack, start_stack
from tests.hf_reference import hf_greedy
from tests.stack.test_parity import QUESTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # two stacks and HF, float32
MAX_TOKENS = 32
HOLDS = re.compile(r"rank (\d+) holds [\d.]+ MB of layer weights \((\d+) bytes")


def _greedy_over_http(stack: Stack, prompts: list[list[int]]) -> list[tuple[str, list[str]]]:
    """Each prompt (token ids) as a concurrent completion: (text, the tokens from logprobs)."""

    async def one(client: openai.AsyncOpenAI, model: str, prompt: list[int]) -> Any:
        return await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(one(client, model, p) for p in prompts))

    replies = asyncio.run(run())
    return [(r.choices[0].text, list(r.choices[0].logprobs.tokens)) for r in replies]


def _serve(tp: int, prompts: list[list[int]]) -> tuple[list[tuple[str, list[str]]], dict[int, int]]:
    """Start a float32 stack with `tp` ranks, run the prompts, stop it; outputs and the
    layer-weight bytes each rank reported."""
    stack = start_stack(
        "--dtype", "float32", "--tensor-parallel-size", str(tp), "--kv-cache-memory", "512MiB",
        timeout_s=600,
    )  # fmt: skip
    try:
        outputs = _greedy_over_http(stack, prompts)
    finally:
        code = stack.stop()
    assert code == 0, stack.output()[-3000:]
    held = {int(m[1]): int(m[2]) for m in HOLDS.finditer(stack.output())}
    return outputs, held


def test_tp2_http_greedy_equals_tp1_and_hf_with_half_the_weights_per_rank(
    tokenizer: Any, default_model_dir: Path
) -> None:
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in QUESTIONS
    ]  # fmt: skip
    two, held_two = _serve(2, prompts)
    one, held_one = _serve(1, prompts)
    expected = hf_greedy(default_model_dir, prompts, MAX_TOKENS, "float32")
    for i, ((text2, tokens2), (text1, tokens1)) in enumerate(zip(two, one, strict=True)):
        assert len(tokens2) == MAX_TOKENS
        assert (tokens2, text2) == (tokens1, text1), f"prompt {i}: tp=2 and tp=1 differ"
        hf_text = tokenizer.decode(expected[i], skip_special_tokens=True)
        assert text2 == hf_text, f"prompt {i}: tp=2 {text2!r} != HF {hf_text!r}"
    assert sorted(held_two) == [0, 1] and list(held_one) == [0]
    for rank, held in held_two.items():
        share = held / held_one[0]
        print(f"rank {rank} of 2 holds {held} bytes of layer weights ({share:.1%} of tp=1's)")
        assert abs(share - 0.5) <= 0.05, f"rank {rank} holds {share:.1%} of the layer weights"
