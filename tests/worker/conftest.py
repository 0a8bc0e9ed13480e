"""Fixtures of the worker tests: prompts, HF references (once per session), worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.grpc_utils import health_status
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def _base_text() -> str:
    import subprocess as sp
    import unittest

    return f"{unittest.__doc__}\n{sp.__doc__}"


@pytest.fixture(scope="module")
def amx_ops():
    """The fused CPU ops where the CPU lends this process AMX tiles for bf16; else the test
    skips and says so."""
    from worker_service.models import cpu_ops

    ops = cpu_ops.load()
    if ops is None or not ops.amx:
        pytest.skip("needs a CPU with AMX tiles for bf16 (amx_tile, amx_bf16)")
    return ops


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def eight_prompts(tokenizer) -> list[list[int]]:
    """8 prompts of 5..600 tokens; four share a long prefix (for the prefix-cache regime)."""
    base = tokenizer(_base_text())["input_ids"]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )

    def enc(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    prompts = [
        enc("Hello, my name is"),
        enc(chat),
        base[:600],
        base[:300] + enc("\nIn one sentence, what is this text about?"),
        base[:150] + enc("\nSummary:"),
        base[:450] + enc("\nThe most important point is"),
        enc("The quick brown fox jumps over the lazy dog because"),
        enc("Once upon a time, in a small village by the sea, there lived an old fisherman " * 6),
    ]
    assert min(map(len, prompts)) == 5 and max(map(len, prompts)) == 600
    return prompts


@pytest.fixture(scope="session")
def hf_fp32_greedy(default_model_dir: Path, eight_prompts: list[list[int]]) -> list[list[int]]:
    """HF generate, float32, 64 greedy tokens per prompt (computed once per session)."""
    from tests.hf_reference import hf_greedy

    return hf_greedy(default_model_dir, eight_prompts, 64, "float32")


def spawn_worker(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start `python -m worker_service ARGS` on a free port; wait until it answers health
    (NOT_SERVING: it reports SERVING only once InitializeCache allocated its KV cache)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker_service", "--port", str(port), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 180
    while health_status(address, timeout_s=1.0) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"worker did not start: {proc.communicate()[1].decode()[-2000:]}")
        time.sleep(0.3)
    return proc, address


def stop_worker(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM and wait; returns the exit code."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -9


@pytest.fixture(scope="session")
def fp32_worker() -> Iterator[str]:
    """Address of a float32 worker process (default model, cpu attention backend)."""
    proc, address = spawn_worker(
        "--model", "default", "--dtype", "float32", "--log-level", "WARNING"
    )
    yield address
    assert stop_worker(proc) == 0
