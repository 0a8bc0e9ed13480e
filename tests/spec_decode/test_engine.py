"""Speculative decoding end to end in process: a tiny random Llama through the real worker
and scheduler (EngineCore), with ngram drafts against the same engine without them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from services.config import SpeculativeConfig
from services.types import SamplingParams
from tests.hf_reference import hf_logits
from tests.spec_decode.chi2 import chisquare_pvalue
from tests.spec_decode.tiny import NGRAM, VOCAB, TinyEngine, save_tiny_llama

# prompts that repeat themselves, so the continuation recurs and drafts get accepted
PROMPTS = [[2 + (i * 5 + j) % 7 for j in range(7)] * 4 for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), logit_scale=30.0)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Iterator[TinyEngine]:
    engine = TinyEngine(tiny_dir, None)
    yield engine
    engine.close()


@pytest.fixture()
def spec(tiny_dir: Path) -> Iterator[TinyEngine]:
    engine = TinyEngine(tiny_dir, NGRAM)
    yield engine
    engine.close()


def _accepted(engine: TinyEngine) -> int:
    return engine.engine.stats().spec_decode_num_accepted_tokens


def test_greedy_identical_to_plain_decoding(reference: TinyEngine, spec: TinyEngine) -> None:
    expected = reference.generate(PROMPTS, GREEDY)
    got = spec.generate(PROMPTS, GREEDY)
    assert got == expected
    stats = spec.engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.num_steps < reference.engine.stats().num_steps  # fewer steps for the same tokens
    assert stats.num_blocks_used == 0


def test_stops_inside_accepted_drafts(reference: TinyEngine, spec: TinyEngine) -> None:
    """max_tokens, stop ids and EOS cut a step's accepted tokens exactly where plain
    decoding would have stopped."""
    (plain,) = reference.generate(PROMPTS[:1], GREEDY)
    stop_id = plain[10]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=(stop_id,), ignore_eos=True),
    ):
        assert spec.generate(PROMPTS[:1], params) == reference.generate(PROMPTS[:1], params)
    assert _accepted(spec) > 0


def test_features_that_turn_speculation_off(reference: TinyEngine, spec: TinyEngine) -> None:
    """Penalties, logprobs, min_tokens, a seed at temperature > 0 and structured output:
    those requests decode one token a step (no drafts) with the same output as without."""
    cases = [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=24, seed=7, ignore_eos=True),
    ]
    for params in cases:
        assert spec.generate(PROMPTS[:2], params) == reference.generate(PROMPTS[:2], params)
    assert spec.engine.stats().spec_decode_num_drafts == 0


def test_mixed_batch_with_and_without_speculation(reference: TinyEngine, spec: TinyEngine) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    penalized = SamplingParams(
        temperature=0.0, max_tokens=40, frequency_penalty=0.4, ignore_eos=True
    )
    params = [plain, penalized] * 4
    ids = [spec.add(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    ref_ids = [reference.add(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    got, expected = spec.run(), reference.run()
    for i, j in zip(ids, ref_ids, strict=True):
        assert [t for o in got[i] for t in o.new_token_ids] == [
            t for o in expected[j] for t in o.new_token_ids
        ]
    assert _accepted(spec) > 0


def test_preemption_keeps_greedy_output(tiny_dir: Path, reference: TinyEngine) -> None:
    """A pool too small for all 8 requests: requests are preempted and recomputed while
    speculating; the output is still plain greedy decoding."""
    small = TinyEngine(tiny_dir, NGRAM, num_blocks=48, block_size=4)
    try:
        got = small.generate(PROMPTS, GREEDY)
        stats = small.engine.stats()
    finally:
        small.close()
    assert got == reference.generate(PROMPTS, GREEDY)
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.num_blocks_used == 0


def test_abort_mid_speculation_frees_every_block(spec: TinyEngine) -> None:
    ids = [spec.add(p, GREEDY) for p in PROMPTS]
    engine = spec.engine
    for _ in range(200):  # step until drafts are being verified
        engine.step()
        if engine.stats().spec_decode_num_drafts >= 8:
            break
    assert engine.scheduler.spec_stats.num_drafts >= 8
    assert any(r.spec_token_ids for r in engine.scheduler.requests.values())
    engine.abort_requests(ids[:5])
    engine.step()
    engine.abort_requests(ids[5:])
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and pool.num_used_blocks == 0
    # the worker dropped them too: a fresh request still decodes right
    assert spec.generate(PROMPTS[:1], GREEDY)[0][:8] != []


def _next_token_probs(model_dir: Path, tokens: list[int]) -> np.ndarray:
    return torch.softmax(hf_logits(model_dir, tokens)[-1], dim=-1).numpy()


def test_temperature_one_matches_the_target_distribution(tmp_path: Path) -> None:
    """4000 samples of 3 tokens at temperature 1 with drafts: the second and third tokens,
    which the rejection sampler decides (accepted draft, recovered or bonus token), follow
    the model's own conditional distributions (HF, fp32; chi-square, p > 1e-3, fixed seed)."""
    model_dir = save_tiny_llama(tmp_path, logit_scale=4.0)  # spread out: ~0.2 at most
    order = np.random.default_rng(0).permutation(VOCAB).tolist()
    prompt = order * 3  # every token recurs, so every first token gets a draft
    n = 4000
    engine = TinyEngine(model_dir, NGRAM, num_blocks=4096, seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    try:
        samples = engine.generate([prompt] * n, params)
        stats = engine.engine.stats()
    finally:
        engine.close()
    assert stats.spec_decode_num_drafts > n * 0.9 and stats.spec_decode_num_accepted_tokens > 100
    p0 = _next_token_probs(model_dir, prompt)
    assert chisquare_pvalue(np.bincount([s[0] for s in samples], minlength=VOCAB), p0 * n) > 1e-3
    ((t1, _),) = Counter(s[0] for s in samples).most_common(1)
    seconds = [s[1] for s in samples if s[0] == t1]
    p1 = _next_token_probs(model_dir, [*prompt, t1])
    assert len(seconds) > 300
    assert chisquare_pvalue(np.bincount(seconds, minlength=VOCAB), p1 * len(seconds)) > 1e-3
    ((t2, _),) = Counter(seconds).most_common(1)
    thirds = [s[2] for s in samples if s[0] == t1 and s[1] == t2]
    p2 = _next_token_probs(model_dir, [*prompt, t1, t2])
    assert chisquare_pvalue(np.bincount(thirds, minlength=VOCAB), p2 * len(thirds)) > 1e-3


def test_draft_model_greedy_identical_with_itself_as_draft(
    tiny_dir: Path, reference: TinyEngine
) -> None:
    """`"method": "draft_model"` with the target as its own draft: every draft is what the
    target would pick (greedy), so nearly all are accepted; the output is plain greedy."""
    spec = SpeculativeConfig(method="draft_model", model=str(tiny_dir), num_speculative_tokens=3)
    engine = TinyEngine(tiny_dir, spec, num_blocks=128)
    try:
        got = engine.generate(PROMPTS, GREEDY)
        stats = engine.engine.stats()
    finally:
        engine.close()
    assert got == reference.generate(PROMPTS, GREEDY)
    assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens > 0
    assert stats.num_blocks_used == 0


def test_draft_model_with_preemption_and_random_sampling(tiny_dir: Path) -> None:
    """A pool too small for all requests (preemption, lookahead slots) and temperature 1:
    every request finishes, nothing leaks."""
    spec = SpeculativeConfig(method="draft_model", model=str(tiny_dir), num_speculative_tokens=3)
    engine = TinyEngine(tiny_dir, spec, num_blocks=48)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
        got = engine.generate(PROMPTS, params)
        stats = engine.engine.stats()
    finally:
        engine.close()
    assert [len(t) for t in got] == [40] * 8
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert engine.engine.scheduler.kv.pool.num_used_blocks == 0
