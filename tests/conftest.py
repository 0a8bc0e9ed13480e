"""Fixtures shared by every test folder."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct); converted once if missing."""
    from services.default_model import resolve_model

    return resolve_model("default")


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
