"""Issue 22 through the offline `LLM`: for each text-only architecture of the registry, a tiny
random checkpoint built with transformers gives HF `generate`'s greedy tokens, token for
token in float32, on 8 prompts x 32 tokens, with whole prefill and with 16-token chunks
(prefix caching on, the default). The sliding-window models see prompts up to 6x their
window; where every layer is windowed, KV blocks in use fall during the decode (blocks
wholly before the window go back to the pool), elsewhere they never do before a request
finishes. The prompts run twice, the second time from the prefix cache. Phi-3's longrope
switch matches HF's logprobs (HF recomputes the cache with the long factors there)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from services.types import EngineCoreOutput, SamplingParams
from tessera import LLM
from tessera.prompts import TokensPrompt
from tests.worker.tiny_dense import NEW_TOKENS
from tests.worker.tiny_families import (
    ALL_FAMILIES,
    ALL_WINDOWED,
    family_prompts,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
BUDGETS = {"whole": 2048, "chunked": 16}  # max_num_batched_tokens


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def family(
    request: pytest.FixtureRequest, tiny_family: Callable[[str], tuple[Path, list[list[int]]]]
) -> tuple[str, Path, list[list[int]]]:
    """(name, checkpoint, HF greedy tokens), built once per session."""
    return request.param, *tiny_family(request.param)


def _recording_used_blocks(llm: LLM) -> list[int]:
    """KV blocks in use after each engine step, until the first request finishes."""
    used: list[int] = []
    step = llm.engine.step
    finished = False

    def recorded(on_scheduled: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        nonlocal finished
        outputs = step(on_scheduled)
        finished |= any(o.finished for o in outputs)
        if not finished:
            used.append(llm.stats().num_blocks_used)
        return outputs

    llm.engine.step = recorded  # type: ignore[method-assign]
    return used


@pytest.mark.parametrize("prefill", list(BUDGETS))
def test_llm_greedy_matches_hf(family: tuple[str, Path, list[list[int]]], prefill: str) -> None:
    name, path, expected = family
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_memory="64MiB",
        max_num_batched_tokens=BUDGETS[prefill],
        max_num_seqs=8,
    )
    try:
        used = _recording_used_blocks(llm)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in family_prompts(name)]
        outputs = llm.generate(prompts, GREEDY)
        outputs += llm.generate(prompts, GREEDY)  # from cached prefixes (window-freed ones too)
        stats, length_dependent = llm.stats(), llm.engine.kv_spec.length_dependent_rope
    finally:
        llm.shutdown()
    assert stats.num_blocks_used == 0  # every block back at the end
    assert (stats.prefix_cache_hits > 0) == (not length_dependent)  # off for Phi-3's longrope
    for k, (out, want) in enumerate(zip(outputs, expected * 2, strict=True)):
        got = list(out.outputs[0].token_ids)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        assert got == want, f"prompt {k} ({len(out.prompt_token_ids)} tokens) diverges at {first}"
    freed = any(b < a for a, b in itertools.pairwise(used))
    assert freed == (name in ALL_WINDOWED), used


def test_phi3_longrope_switch_matches_hf_logprobs(
    tiny_family: Callable[[str], tuple[Path, list[list[int]]]],
) -> None:
    """A 30-token prompt decodes past original_max_position_embeddings (32), where HF's Phi-3
    recomputes its cache with the long factors: each token's logprob equals HF's (the greedy
    tokens alone can agree by chance when the keys keep the short factors)."""
    import torch

    from tests.hf_reference import hf_model

    path, _ = tiny_family("phi3")
    prompt = family_prompts("phi3")[2]
    assert len(prompt) == 30
    inputs = torch.tensor([prompt])
    hf = hf_model(path).generate(
        inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=8,
        eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    want = [torch.log_softmax(s[0], -1) for s in hf.scores]
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        (out,) = llm.generate(TokensPrompt(prompt_token_ids=prompt), params)
    finally:
        llm.shutdown()
    completion = out.outputs[0]
    assert completion.token_ids == hf.sequences[0, 30:].tolist()
    assert completion.logprobs is not None
    for k, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert entry[token].logprob == pytest.approx(want[k][token].item(), abs=1e-4), k
