"""LLM.embed against HF `AutoModel` hidden states pooled the same way (fp32, within
tests.hf_reference.EMBEDDING_TOLERANCE).

The default model (a decoder, no sentence-transformers files: last token + normalize) and
tiny random Llamas with a sentence-transformers config written beside them (MEAN, CLS, MAX
pooling with a Normalize module; Matryoshka dimensions), batched, with whole and chunked
prefill; no KV block is left owned afterwards.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tessera import LLM, EmbeddingRequestOutput, PoolingParams
from tessera.prompts import TokensPrompt
from tests.hf_reference import assert_embeddings_close, hf_embeddings
from tests.worker.test_qwen_models import TINY

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _texts() -> list[str]:
    """16 inputs from 1 word to a few hundred tokens."""
    base = (
        "Paged attention stores the key and value cache in fixed-size blocks, so a "
        "scheduler can batch requests of any length without fragmentation. "
    )
    return [" ".join(["word"] * (i + 1)) if i < 4 else base * (i - 3) for i in range(16)]


def _tiny_ids() -> list[list[int]]:
    lengths = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 50, 64, 77, 100, 130)
    return [[(11 * i + 5 * k + 3) % 320 for i in range(n)] for k, n in enumerate(lengths)]


def _vectors(outputs: list[EmbeddingRequestOutput]) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in outputs]


def _assert_no_leaks(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert scheduler.kv.pool.num_used_blocks == 0


@pytest.fixture(scope="module", params=[2048, 48], ids=["whole-prefill", "chunked-prefill"])
def default_llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    llm = LLM(
        model="default",
        dtype="float32",
        runner="pooling",
        max_num_batched_tokens=request.param,
        kv_cache_memory="256MiB",
    )
    yield llm
    llm.shutdown()


def test_default_model_last_token_matches_hf(default_llm: LLM, default_model_dir: Path) -> None:
    texts = _texts()
    outputs = default_llm.embed(texts)
    ids = [o.prompt_token_ids for o in outputs]
    assert max(map(len, ids)) > 200 and min(map(len, ids)) <= 2
    assert ids == [default_llm.tokenizer.encode(t) for t in texts]
    assert [o.request_id for o in outputs] == sorted({o.request_id for o in outputs}, key=int)
    assert_embeddings_close(_vectors(outputs), hf_embeddings(default_model_dir, ids, "LAST", True))
    _assert_no_leaks(default_llm)


def test_last_token_pooling_with_prefix_cache_hits(
    default_llm: LLM, default_model_dir: Path
) -> None:
    """Last-token pooling takes prefix-cache hits (the last token is always computed): the
    second pass over shared-prefix inputs hits, and the vectors stay HF's."""
    texts = _texts()[4:]
    kv = default_llm.engine.scheduler.kv
    first = default_llm.embed(texts)
    hits = kv.prefix_hits
    second = default_llm.embed(texts)
    assert kv.prefix_hits - hits > 1000  # nearly every block of the second pass
    ids = [o.prompt_token_ids for o in second]
    want = hf_embeddings(default_model_dir, ids, "LAST", True)
    assert_embeddings_close(_vectors(second), want)
    assert_embeddings_close(_vectors(first), want)
    _assert_no_leaks(default_llm)


def test_default_model_options(default_llm: LLM, default_model_dir: Path) -> None:
    """normalize=False gives the raw last hidden state; token-id prompts; no Matryoshka."""
    ids = [[1, 2, 3, 4, 5], [42] * 70]
    prompts: list[TokensPrompt] = [{"prompt_token_ids": p} for p in ids]
    raw = default_llm.embed(prompts, PoolingParams(normalize=False))
    assert_embeddings_close(_vectors(raw), hf_embeddings(default_model_dir, ids, "LAST", False))
    with pytest.raises(ValueError, match="does not support matryoshka"):
        default_llm.embed("hello", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="runner"):
        default_llm.generate("hello")
    _assert_no_leaks(default_llm)


def _tiny_st_model(root: Path, pooling: str) -> Path:
    """A random Llama with sentence-transformers files: `pooling` + Normalize, Matryoshka
    dimensions 16 and 32, and the default model's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.default_model import resolve_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    with torch.no_grad():  # HF sets norms to 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.config.matryoshka_dimensions = [16, 32]
    model.save_pretrained(root)
    for name in TOKENIZER_FILES:
        shutil.copy(resolve_model("default") / name, root / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (root / "modules.json").write_text(json.dumps(modules))
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    flags = {f"pooling_mode_{m}": m == pooling for m in modes}
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": TINY["hidden_size"], **flags})
    )
    (root / "2_Normalize").mkdir()
    return root


@pytest.mark.parametrize(
    ("mode", "pooling"), [("mean_tokens", "MEAN"), ("cls_token", "CLS"), ("max_tokens", "MAX")]
)
@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prefill", "chunked-prefill"])
def test_sentence_transformers_pooling_matches_hf(
    tmp_path: Path, mode: str, pooling: str, budget: int
) -> None:
    model_dir = _tiny_st_model(tmp_path / "tiny-st", mode)
    ids = _tiny_ids()
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        task="embed",
        max_num_batched_tokens=budget,
        kv_cache_memory="64MiB",
    )
    try:
        assert_embeddings_close(
            _vectors(llm.embed(ids)), hf_embeddings(model_dir, ids, pooling, True)
        )
        short = llm.embed(ids[:5], PoolingParams(dimensions=16))
        assert_embeddings_close(
            _vectors(short), hf_embeddings(model_dir, ids[:5], pooling, True, 16)
        )
        raw = llm.embed(ids[-3:], PoolingParams(dimensions=32, normalize=False))
        assert_embeddings_close(
            _vectors(raw), hf_embeddings(model_dir, ids[-3:], pooling, False, 32)
        )
        with pytest.raises(ValueError, match=r"only supports \[16, 32\]"):
            llm.embed(ids[:1], PoolingParams(dimensions=20))
        _assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_preempted_pooling_requests_start_their_pool_afresh(tmp_path: Path) -> None:
    """A pool of 16 blocks (256 tokens) for 16 prompts of 150..165 tokens with a 200-token
    budget: a prompt's second chunk finds no blocks, the latest request is preempted
    mid-prompt and recomputed from scratch; vectors are still HF's."""
    model_dir = _tiny_st_model(tmp_path / "tiny-st", "mean_tokens")
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    block_bytes = 2 * 4 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * head_dim * 16
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        runner="pooling",
        max_num_batched_tokens=200,
        kv_cache_memory=16 * block_bytes,  # K and V, float32, 16-token blocks
    )
    try:
        assert llm.engine.num_blocks == 16
        ids = [[(11 * i + 5 * k + 3) % 320 for i in range(150 + k)] for k in range(16)]
        assert_embeddings_close(
            _vectors(llm.embed(ids)), hf_embeddings(model_dir, ids, "MEAN", True)
        )
        assert llm.engine.scheduler.num_preemptions > 0
        _assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_tensor_parallel_pooling_matches_hf(tmp_path: Path) -> None:
    """Two ranks (heads and MLP columns split): rank 0 pools the all-reduced hidden states."""
    model_dir = _tiny_st_model(tmp_path / "tiny-st", "mean_tokens")
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        runner="pooling",
        tensor_parallel_size=2,
        max_num_batched_tokens=24,
        kv_cache_memory="64MiB",
    )
    try:
        ids = _tiny_ids()
        assert_embeddings_close(
            _vectors(llm.embed(ids)), hf_embeddings(model_dir, ids, "MEAN", True)
        )
        _assert_no_leaks(llm)
    finally:
        llm.shutdown()
