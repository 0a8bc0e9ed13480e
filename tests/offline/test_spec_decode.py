"""Speculative decoding through the offline `LLM` on the default model in float32: greedy
output with ngram drafts is the output without them (issue 23, acceptance 1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.spec_workload import repetitive_chats
from services.types import SamplingParams, StructuredOutputParams
from tessera import LLM

pytestmark = pytest.mark.slow

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def plain() -> Iterator[LLM]:
    llm = LLM(dtype="float32", kv_cache_memory="512MiB", max_num_seqs=8)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec() -> Iterator[LLM]:
    llm = LLM(dtype="float32", kv_cache_memory="512MiB", max_num_seqs=8, speculative_config=NGRAM)
    yield llm
    llm.shutdown()


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_8_prompts_64_tokens_identical(plain: LLM, spec: LLM) -> None:
    chats = repetitive_chats()
    assert len(chats) == 8
    expected = _tokens(plain.chat(chats, GREEDY))
    got = _tokens(spec.chat(chats, GREEDY))
    assert got == expected
    assert all(len(t) == 64 for t in got)
    stats = spec.stats()
    assert stats.spec_decode_num_accepted_tokens > 8 * 16  # most of a copied answer is drafted
    assert stats.num_blocks_used == 0


def test_draft_model_greedy_identical_with_the_default_model_as_its_own_draft(
    plain: LLM, default_model_dir: Path
) -> None:
    draft = {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 3}
    llm = LLM(dtype="float32", kv_cache_memory="512MiB", max_num_seqs=8, speculative_config=draft)
    try:
        chats = repetitive_chats()
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        got = _tokens(llm.chat(chats, params))
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert got == _tokens(plain.chat(chats, params))
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens > 0


def test_stop_ids_and_structured_output_with_speculation_on(plain: LLM, spec: LLM) -> None:
    """Requests with a grammar decode without drafts beside ones that speculate; stop token
    ids end a request inside accepted drafts exactly as without speculation."""
    chats = repetitive_chats()[:2]
    (first,) = _tokens(plain.chat(chats[:1], GREEDY))
    stop = SamplingParams(temperature=0, max_tokens=64, stop_token_ids=(first[20],))
    assert _tokens(spec.chat(chats, stop)) == _tokens(plain.chat(chats, stop))
    choice = SamplingParams(
        temperature=0,
        max_tokens=16,
        structured_output=StructuredOutputParams(choice=("harbour", "railway")),
    )
    mixed = [GREEDY, choice]
    got, expected = spec.chat(chats, mixed), plain.chat(chats, mixed)
    assert _tokens(got) == _tokens(expected)
    assert got[1].outputs[0].text in ("harbour", "railway")
