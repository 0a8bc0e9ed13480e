"""Sliding-window attention (issue 22): tiny random Mistral (every layer windowed), Qwen2
with use_sliding_window (windows from max_window_layers on) and Phi-3, windows far shorter
than the prompts: Tessera greedy == HF generate token for token in float32, 8 prompts x 32
tokens, whole and chunked prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.worker.tiny_dense import BUDGETS, assert_parity, save_tiny
from worker_service.models.config import read_model_config

WINDOWED: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    "mistral": ("mistral", dict(sliding_window=16), (16, 16)),
    "qwen2": (
        "qwen2",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=24, max_window_layers=1),
        (0, 24, 24),
    ),
    "phi3": ("phi3", dict(sliding_window=20, pad_token_id=0), (20, 20)),
}


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, overrides, _ = WINDOWED[request.param]
    return save_tiny(model_type, tmp_path_factory.mktemp(request.param), **overrides)


def test_layer_windows_are_read(windowed: Path) -> None:
    cfg = read_model_config(windowed)
    expected = next(w for t, _, w in WINDOWED.values() if cfg.architecture.lower().startswith(t))
    assert cfg.sliding_windows == expected


@pytest.mark.parametrize("prefill", list(BUDGETS))
def test_sliding_window_greedy_matches_hf(windowed: Path, prefill: str) -> None:
    assert_parity(windowed, BUDGETS[prefill])
