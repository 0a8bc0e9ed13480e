"""`prompt_logprobs` (vLLM's SamplingParams field) equal HF's log-softmax over the prompt in
float32, whether the prompt is prefilled whole, in chunks, after its prefix was cached, or
recomputed after a preemption; sampled-token `logprobs` come back in vLLM's shape too."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.types import SamplingParams
from tessera import LLM, Logprob, RequestOutput
from tests.hf_reference import hf_logits

pytestmark = pytest.mark.slow

K = 5
TEXTS = [
    "Paris is the capital of France, and Berlin is the capital of Germany. The capital of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "Once upon a time, in a land far away, there lived a quiet dragon who loved to read.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987,",
]
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)


def _check_against_hf(model_dir: Path, out: RequestOutput) -> None:
    ids = out.prompt_token_ids
    ref = torch.log_softmax(hf_logits(model_dir, ids), dim=-1)  # [n, V]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):  # position j: prompt token j given tokens < j
        entry = plp[j]
        assert entry is not None
        chosen = entry[ids[j]]
        assert chosen.logprob == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        assert chosen.rank == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
        top = ref[j - 1].topk(K)
        ranked = {t: lp for t, lp in entry.items() if lp.rank is not None and lp.rank <= K}
        assert len(ranked) == K
        for value, token_id in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            assert ranked[token_id].logprob == pytest.approx(value, abs=1e-4)


def _llm(**kwargs: object) -> LLM:
    return LLM(dtype="float32", max_num_seqs=8, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def whole() -> Iterator[LLM]:
    llm = _llm(kv_cache_memory="256MiB")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def chunked() -> Iterator[LLM]:
    llm = _llm(kv_cache_memory="256MiB", max_num_batched_tokens=16)
    yield llm
    llm.shutdown()


def test_whole_prefill_matches_hf(whole: LLM, default_model_dir: Path) -> None:
    for out in whole.generate(TEXTS, PARAMS):
        _check_against_hf(default_model_dir, out)


def test_chunked_prefill_matches_hf(chunked: LLM, default_model_dir: Path) -> None:
    outputs = chunked.generate(TEXTS, PARAMS)
    assert all(len(o.prompt_token_ids) > 16 for o in outputs)  # every prompt took 2+ chunks
    for out in outputs:
        _check_against_hf(default_model_dir, out)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(
    whole: LLM, default_model_dir: Path
) -> None:
    prefix = TEXTS[2] * 2
    plain = SamplingParams(temperature=0, max_tokens=1)
    whole.generate(prefix, plain)  # the prefix's blocks are now cached
    [warm] = whole.generate(prefix + " The end.", plain)
    assert warm.num_cached_tokens >= 16  # a plain request reads the cache
    [out] = whole.generate(prefix + " The end.", PARAMS)
    assert out.num_cached_tokens == 0  # one asking for prompt logprobs does not (as vLLM)
    _check_against_hf(default_model_dir, out)


def test_preempted_prefills_report_each_position_once(default_model_dir: Path) -> None:
    llm = _llm(kv_cache_memory="12MiB", max_num_batched_tokens=32)  # 16 blocks of 16 tokens
    try:
        texts = [t * 2 for t in TEXTS]  # ~40-70 tokens each: the pool cannot hold all four
        outputs = llm.generate(texts, dataclasses.replace(PARAMS, max_tokens=24))
        assert llm.engine.scheduler.num_preemptions > 0
        for out in outputs:
            _check_against_hf(default_model_dir, out)
        assert llm.engine.scheduler.kv.pool.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_sampled_logprobs_come_in_vllm_shape(whole: LLM, default_model_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    [out] = whole.generate(TEXTS[0], params)
    completion = out.outputs[0]
    assert out.prompt_logprobs is None
    assert completion.logprobs is not None and len(completion.logprobs) == 3
    ids = out.prompt_token_ids + completion.token_ids
    ref = torch.log_softmax(hf_logits(default_model_dir, ids), dim=-1)
    for i, (token_id, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        first = next(iter(entry.items()))
        assert first[0] == token_id and first[1].rank == 1  # greedy: the sampled token leads
        assert isinstance(first[1], Logprob) and first[1].decoded_token
        row = ref[len(out.prompt_token_ids) + i - 1]
        assert first[1].logprob == pytest.approx(row[token_id].item(), abs=1e-4)
