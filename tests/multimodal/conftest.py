"""Tiny random VLM directories, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multimodal.tiny_vlm import build_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), default_model_dir)
