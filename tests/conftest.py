"""Fixtures shared by every test folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import free_port

__all__ = ["free_port"]  # tests import it from here


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct); converted once if missing."""
    from services.default_model import resolve_model

    return resolve_model("default")
