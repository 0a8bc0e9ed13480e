"""Greedy outputs agree through the HTTP stack, the offline LLM API and HF transformers,
all in float32 (issue 6, acceptance 2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from benchmarks.stack import Stack, start_stack
from services.types import SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a neural network is in one sentence.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a short tip for learning to cook, and explain why it helps beginners "
    "who are nervous in the kitchen and have never followed a recipe before.",
]


@pytest.fixture(scope="module")
def fp32_stack() -> Iterator[Stack]:
    stack = start_stack("--dtype", "float32")
    yield stack
    stack.stop()


def http_answers(stack: Stack) -> list[str]:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    answers = []
    for question in QUESTIONS:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        answers.append(reply.choices[0].message.content or "")
    return answers


def offline_answers() -> list[str]:
    from tessera import LLM

    llm = LLM(dtype="float32", kv_cache_memory="1GiB")
    try:
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        outputs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        return [o.outputs[0].text for o in outputs]
    finally:
        llm.shutdown()


def hf_answers(model_dir: Path) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    answers = []
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt",
            return_dict=True,
        )["input_ids"]  # fmt: skip
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


def test_http_offline_and_hf_agree_in_float32(fp32_stack: Stack, default_model_dir: Path) -> None:
    via_http = http_answers(fp32_stack)
    via_offline = offline_answers()
    via_hf = hf_answers(default_model_dir)
    assert "Paris" in via_hf[0]
    for question, a, b, c in zip(QUESTIONS, via_http, via_offline, via_hf, strict=True):
        assert a == b == c, f"{question!r}: http={a!r} offline={b!r} hf={c!r}"


def test_completion_prompt_logprobs_equal_hf(fp32_stack: Stack, default_model_dir: Path) -> None:
    """vLLM's `prompt_logprobs` field and `echo` + `logprobs`, through the HTTP stack."""
    import torch

    from tests.hf_reference import hf_logits

    client = openai.OpenAI(base_url=f"{fp32_stack.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    text = QUESTIONS[7]
    reply = client.completions.create(
        model=model, prompt=text, max_tokens=2, temperature=0, logprobs=1, echo=True,
        extra_body={"prompt_logprobs": 3},
    )  # fmt: skip
    choice = reply.choices[0]
    plp = (choice.model_extra or {})["prompt_logprobs"]
    prompt = _prompt_ids(fp32_stack, text)
    assert plp[0] is None and len(plp) == len(prompt) > 20
    assert [int(next(iter(p))) for p in plp[1:]] == prompt[1:]  # the prompt's token leads
    ref = torch.log_softmax(hf_logits(default_model_dir, prompt), dim=-1)  # [n, V]
    echoed = (choice.logprobs.token_logprobs if choice.logprobs else None) or []
    for j in range(1, len(prompt)):
        entry = plp[j]
        assert entry[str(prompt[j])]["logprob"] == pytest.approx(
            ref[j - 1, prompt[j]].item(), abs=1e-4
        )
        top = ref[j - 1].topk(3).indices.tolist()
        assert {int(t) for t, v in entry.items() if v["rank"] <= 3} >= set(top)
        assert echoed[j] == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)  # echo agrees
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(
            model=model, prompt=text, stream=True, extra_body={"prompt_logprobs": 1}
        )


def _prompt_ids(stack: Stack, text: str) -> list[int]:
    import httpx

    reply = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": text}, timeout=10)
    reply.raise_for_status()
    return list(reply.json()["tokens"])
