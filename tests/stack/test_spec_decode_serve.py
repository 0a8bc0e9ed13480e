"""Speculative decoding through `tessera serve` (three processes, the openai client): greedy
chat answers with ngram drafts equal the offline engine's without them; the acceptance
counters reach /metrics (issue 23, acceptance 1)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from benchmarks.spec_workload import repetitive_chats
from benchmarks.stack import Stack, start_stack
from services.types import SamplingParams
from tessera import LLM

pytestmark = pytest.mark.slow

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


DRAFT = {"method": "draft_model", "model": "default", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """The offline engine's greedy answers without speculation."""
    llm = LLM(dtype="float32", kv_cache_memory="512MiB", max_num_seqs=8)
    try:
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        return [o.outputs[0].text for o in llm.chat(repetitive_chats(), params)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=[NGRAM, DRAFT], ids=["ngram", "draft_model"])
def stack(request: pytest.FixtureRequest, expected: list[str]) -> Iterator[Stack]:
    del expected  # computed first, before the stack takes the CPU
    stack = start_stack("--dtype", "float32", "--speculative-config", json.dumps(request.param))
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def _metric(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


def test_greedy_chat_identical_and_counters_on_metrics(stack: Stack, expected: list[str]) -> None:
    chats = repetitive_chats()
    client: Any = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    for chat, want in zip(chats, expected, strict=True):
        reply = client.chat.completions.create(
            model=model, messages=chat, temperature=0, max_tokens=64,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert reply.choices[0].message.content == want
    two = client.chat.completions.create(
        model=model, messages=chats[0], temperature=0, max_tokens=64, n=2,
        extra_body={"ignore_eos": True}, stop=[" herring"],
    )  # fmt: skip
    cut = expected[0].split(" herring")[0]
    assert [c.message.content for c in two.choices] == [cut, cut]
    metrics = httpx.get(f"{stack.base_url}/metrics").text
    drafts = _metric(metrics, "tessera_scheduler_spec_decode_num_draft_tokens")
    accepted = _metric(metrics, "tessera_scheduler_spec_decode_num_accepted_tokens")
    assert _metric(metrics, "tessera_scheduler_spec_decode_num_drafts") > 0
    assert drafts >= accepted > 8 * 16
