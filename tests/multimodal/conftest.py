"""Tiny random VLM directories, built once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tiny_vlm import BUILDERS, build_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), default_model_dir)


@pytest.fixture(scope="module", params=list(BUILDERS))
def model_dir(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> Path:
    """Each tiny VLM in turn (LLaVA, Idefics3), built once per module."""
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param), default_model_dir)


def offline_llm(model_dir: Path, max_num_batched_tokens: int) -> Iterator[Any]:
    """An offline LLM over `model_dir` in float32 (for a fixture to `yield from`)."""
    from tessera import LLM

    engine = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_memory="32MiB",
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=8,
    )
    yield engine
    engine.shutdown()
