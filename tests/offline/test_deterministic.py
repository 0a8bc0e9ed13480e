"""--deterministic on the default model in bf16 (as served), through the offline `LLM`: the same
greedy prompts alone, in a mixed batch with prompts of other lengths, after a prefix-cache hit
and with a small chunked-prefill budget give the same token ids and bit-identical logprobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.types import SamplingParams
from tessera import LLM, RequestOutput

pytestmark = pytest.mark.slow

PREFIX = (
    "You are a careful assistant. Answer briefly and precisely. The museum opens at nine, "
    "closes at five, and is free on Sundays; the cafe on the second floor serves soup, tea "
    "and three kinds of cake, and the garden behind it has a pond with old carp in it. "
) * 3  # ~170 tokens: whole blocks of it are shared by the PROMPTS
PROMPTS = [
    PREFIX + "Question: when does the museum close?",
    PREFIX + "Question: what does the cafe serve?",
]
OTHERS = ["Hi.", "Write a haiku about rain.", "1, 2, 3, 4," * 30]  # other lengths
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


def _llm(**kwargs: object) -> LLM:
    return LLM(kv_cache_memory="128MiB", max_num_seqs=8, deterministic=True, **kwargs)  # type: ignore[arg-type]


def _result(out: RequestOutput) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """Token ids, and each position's top-5 (token id, logprob) exactly as returned."""
    completion = out.outputs[0]
    assert completion.logprobs is not None
    tops = [[(t, lp.logprob) for t, lp in pos.items()] for pos in completion.logprobs]
    return list(completion.token_ids), tops


@pytest.fixture(scope="module")
def alone() -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Each prompt alone on a fresh engine without prefix caching: the reference."""
    llm = _llm(enable_prefix_caching=False)
    try:
        return [_result(llm.generate(p, PARAMS)[0]) for p in PROMPTS]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def cached() -> Iterator[LLM]:
    llm = _llm()
    yield llm
    llm.shutdown()


def test_a_mixed_batch_gives_what_each_prompt_gives_alone(
    alone: list[tuple[list[int], list[list[tuple[int, float]]]]],
) -> None:
    llm = _llm(enable_prefix_caching=False)
    try:
        outs = llm.generate([OTHERS[0], PROMPTS[0], *OTHERS[1:], PROMPTS[1]], PARAMS)
    finally:
        llm.shutdown()
    assert [_result(outs[1]), _result(outs[4])] == alone


def test_a_prefix_cache_hit_gives_what_the_prompt_gives_alone(
    alone: list[tuple[list[int], list[list[tuple[int, float]]]]], cached: LLM
) -> None:
    cached.generate(PREFIX + "Question: is the garden open?", PARAMS)  # caches PREFIX's blocks
    outs = [cached.generate(p, PARAMS)[0] for p in PROMPTS]
    assert all(o.num_cached_tokens >= 128 for o in outs)
    assert [_result(o) for o in outs] == alone
    batched = cached.generate([*OTHERS, *PROMPTS], PARAMS)[-2:]  # hits, in a mixed batch
    assert [_result(o) for o in batched] == alone


def test_chunked_prefill_gives_what_the_prompt_gives_alone(
    alone: list[tuple[list[int], list[list[tuple[int, float]]]]],
) -> None:
    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=24)
    try:
        outs = llm.generate([*PROMPTS, OTHERS[2]], PARAMS)  # 24 tokens a step, shared
    finally:
        llm.shutdown()
    assert [_result(o) for o in outs[:2]] == alone
