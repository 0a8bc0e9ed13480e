"""--kv-cache-dtype through the offline `LLM` on the default model (bf16, as served): the
handshake gives >= 1.9x the blocks at the same memory, greedy output over an int8 or fp8 KV
cache agrees with the model-dtype cache, and perplexity stays close to it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks import quality
from services.types import SamplingParams
from tessera import LLM

MEMORY = "64MiB"
NEW_TOKENS = 32


def _llm(kv: str) -> LLM:
    return LLM(kv_cache_memory=MEMORY, kv_cache_dtype=kv, max_num_seqs=8)


@pytest.fixture(scope="module")
def llms() -> Iterator[dict[str, LLM]]:
    made = {kv: _llm(kv) for kv in ("auto", "int8", "fp8_e4m3")}
    yield made
    for llm in made.values():
        llm.shutdown()


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(quality.PROMPTS, params)]


def test_the_handshake_counts_blocks_at_the_smaller_size(llms: dict[str, LLM]) -> None:
    auto = llms["auto"].engine
    for kv, dtype in (("int8", "int8"), ("fp8_e4m3", "float8_e4m3fn")):
        engine = llms[kv].engine
        assert engine.kv_spec.dtype == dtype and auto.kv_spec.dtype == "bfloat16"
        assert engine.num_blocks >= 1.9 * auto.num_blocks, (kv, engine.num_blocks)
        head_dim = auto.kv_spec.head_dim  # 64: 66 bytes a head-token against 128
        ratio = auto.kv_spec.bytes_per_block / engine.kv_spec.bytes_per_block
        assert ratio == 2 * head_dim / (head_dim + 2)


# (prompts of 8 equal over all 32 tokens, share of the 8 x 32 tokens in common prefixes) at
# least. Measured (bf16): int8 4/8 on an AVX2 EPYC; 2/8 with 72% and 5/8 with 80% on an AMX
# Xeon (native bf16 GEMMs round elsewhere, so greedy ties break elsewhere); 4/8 with 65% on a
# Zen 4 EPYC (few-row GEMMs on bf16 pair dot products); fp8 e4m3 (3
# mantissa bits) 1/8 with 39% and 34% there (2/8 with 50% even in float32): its noise flips
# near-tied tokens early, so its quality bar is the perplexity test below.
GREEDY_BARS = {"int8": (2, 0.6), "fp8_e4m3": (0, 0.25)}


@pytest.mark.parametrize("kv", sorted(GREEDY_BARS))
def test_greedy_agrees_with_the_model_dtype_cache(llms: dict[str, LLM], kv: str) -> None:
    """8 prompts x 32 tokens; bf16 rounding makes exact agreement a matter of luck where two
    logits tie, so the bar is long common prefixes (GREEDY_BARS)."""
    expected, got = _greedy(llms["auto"]), _greedy(llms[kv])
    prefixes = [quality.common_prefix(a, b) for a, b in zip(expected, got, strict=True)]
    equal = sum(p == NEW_TOKENS for p in prefixes)
    print(f"{kv} KV vs auto: {equal}/8 prompts equal over {NEW_TOKENS} tokens, prefixes {prefixes}")
    least_equal, least_share = GREEDY_BARS[kv]
    assert equal >= least_equal and sum(prefixes) >= least_share * 8 * NEW_TOKENS
    assert llms[kv].stats().num_blocks_used == 0  # every block came back


# Measured on this 600-token sample (bf16): int8 1.0032x with K Hadamard-rotated
# (attention.kv_rotation; 1.013x before it), fp8 1.016x; the 1% target is the quality
# benchmark's (the whole text, 512-token windows).
@pytest.mark.parametrize("kv,bound", [("int8", 1.01), ("fp8_e4m3", 1.03)])
def test_perplexity_within_bound_of_the_model_dtype_cache(
    llms: dict[str, LLM], kv: str, bound: float
) -> None:
    ids = llms["auto"].tokenizer.encode(quality.TEXT.read_text(), False)[:600]
    base = quality.perplexity(llms["auto"], ids, window=300)
    ours = quality.perplexity(llms[kv], ids, window=300)
    print(f"{kv} KV perplexity {ours:.4f} vs auto {base:.4f} ({ours / base:.4f}x)")
    assert ours / base < bound


def test_an_unknown_kv_cache_dtype_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        LLM(kv_cache_dtype="fp8_e5m2")
