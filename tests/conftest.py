"""Fixtures shared by every test folder."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.soak import free_port

__all__ = ["free_port"]  # tests import it from here


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct); converted once if missing."""
    from services.default_model import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tiny_family(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Callable[[str], tuple[Path, list[list[int]]]]:
    """name -> (the tiny random checkpoint of that architecture, HF's greedy tokens for its
    eight prompts), each built once per session (tests/worker/tiny_families.py)."""
    from tests.worker.tiny_families import family_reference, save_family

    @functools.cache
    def build(name: str) -> tuple[Path, list[list[int]]]:
        path = save_family(name, tmp_path_factory.mktemp(name), default_model_dir)
        return path, family_reference(name, path)

    return build
