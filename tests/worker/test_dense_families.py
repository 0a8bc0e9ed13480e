"""Dense families of issue 22, tiny random checkpoints built with transformers: Phi-3
(fused checkpoint projections, longrope), Phi-4-mini (partial rotary), SmolLM3 (NoPE layers),
Qwen2.5 (Qwen2 with tied embeddings): Tessera greedy == HF generate token for token in
float32, 8 prompts x 32 tokens, whole and chunked prefill; features not implemented are
refused naming the config field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.tiny_dense import BUDGETS, assert_parity, save_tiny
from worker_service.attention.reference import ReferenceAttentionBackend
from worker_service.loader import load_model


def _longrope(half: int) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 0.7 * i for i in range(half)],
    }


PHI: dict[str, Any] = dict(
    pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=32
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3": ("phi3", dict(PHI, max_position_embeddings=160, rope_scaling=_longrope(8))),
    # Phi-4-mini: 3/4 of each head rotates (12 of 16 dims), tied embeddings
    "phi4_mini": (
        "phi3",
        dict(
            PHI,
            max_position_embeddings=160,
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            rope_scaling=_longrope(6),
        ),
    ),
    # every second layer without rope (HF: no_rope_layers[i] == 0)
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=2, pad_token_id=0)),
    "qwen2_5": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides = FAMILIES[request.param]
    return save_tiny(model_type, tmp_path_factory.mktemp(request.param), **overrides)


@pytest.mark.parametrize("prefill", list(BUDGETS))
def test_family_greedy_matches_hf(family_model: Path, prefill: str) -> None:
    assert_parity(family_model, BUDGETS[prefill])


def _edited(src: Path, dst: Path, **fields: Any) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **fields}))
    return dst


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"no_rope_layers": [1, 0]}, "no_rope_layers"),  # NoPE is SmolLM3's, not Llama's
    ],
)
def test_unimplemented_feature_is_refused(
    tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    model = save_tiny("llama", tmp_path / "base")
    edited = _edited(model, tmp_path / "edited", **fields)
    with pytest.raises(ValueError, match=named):
        load_model(edited, torch.float32, torch.device("cpu"), ReferenceAttentionBackend())
