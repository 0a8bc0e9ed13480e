"""Gemma 2 / Gemma 3 text (issue 22), tiny random checkpoints built with transformers, with
16-token windows on alternate layers: Tessera greedy == HF generate token for token in
float32, 8 prompts x 32 tokens, whole and chunked prefill (Gemma 2 with attention and
final logit soft-capping)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.tiny_dense import BUDGETS, assert_parity, save_tiny
from worker_service.attention.reference import ReferenceAttentionBackend
from worker_service.loader import load_model

ALTERNATING = ["sliding_attention", "full_attention"] * 2
GEMMA: dict[str, Any] = dict(
    num_hidden_layers=4,
    head_dim=16,
    query_pre_attn_scalar=24,  # != head_dim: the scale must come from it
    sliding_window=16,
    layer_types=ALTERNATING,
    pad_token_id=0,
    tie_word_embeddings=True,
)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # scores of a tiny random model are small: scale 1 (not 1/sqrt(24)) and a cap of 0.2
    # change them a lot
    "gemma2": (
        "gemma2",
        dict(
            GEMMA, query_pre_attn_scalar=1, attn_logit_softcapping=0.2, final_logit_softcapping=3.0
        ),
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            GEMMA,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        ),
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = MODELS[request.param]
    return save_tiny(model_type, tmp_path_factory.mktemp(request.param), **overrides)


@pytest.mark.parametrize("prefill", list(BUDGETS))
def test_gemma_greedy_matches_hf(gemma: Path, prefill: str) -> None:
    assert_parity(gemma, BUDGETS[prefill], attn_implementation="eager")


def test_final_logit_softcapping_is_applied(tmp_path: Path) -> None:
    model_type, overrides = MODELS["gemma2"]
    path = save_tiny(model_type, tmp_path, **overrides)
    model = load_model(path, torch.float32, torch.device("cpu"), ReferenceAttentionBackend())
    logits = model.compute_logits(torch.randn(5, 64) * 100)
    assert logits.abs().max() <= 3.0


def test_attention_softcapping_is_read(tmp_path: Path) -> None:
    model_type, overrides = MODELS["gemma2"]
    path = save_tiny(model_type, tmp_path, **overrides)
    model = load_model(path, torch.float32, torch.device("cpu"), ReferenceAttentionBackend())
    assert {a.softcap for a in model.attention_layers()} == {0.2}
