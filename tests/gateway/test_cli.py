"""`python -m gateway` as a process: serves, then drains on SIGTERM (in-flight stream finishes)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.tokenizer import Tokenizer
from tests.conftest import free_port
from tests.gateway.conftest import ANSWER
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine, start_fake_engine

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def engine_address(tokenizer: Tokenizer) -> Iterator[tuple[FakeEngine, str]]:
    engine = FakeEngine(tokenizer.encode(ANSWER, add_special_tokens=False), token_delay_s=0.1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start_fake_engine(engine), loop).result(10)
    yield engine, f"127.0.0.1:{server.port}"
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the gateway did not become healthy")


def test_help_lists_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0
    for flag in ("--scheduler", "--served-model-name", "--grpc-port", "--api-key", "--max-queued-requests",
                 "--cors-allow-origin", "--drain-timeout", "--log-level", "--max-n",
                 "--max-logprobs", "--max-request-tokens", "--request-timeout"):  # fmt: skip
        assert flag in out.stdout


def test_process_serves_then_drains_on_sigterm(engine_address: tuple[FakeEngine, str]) -> None:
    _, address = engine_address
    port = free_port()
    args = [
        "--scheduler",
        address,
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--drain-timeout",
        "20",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", *args], cwd=ROOT, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
        }
        with (
            httpx.Client(base_url=url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = http.post("/v1/chat/completions", json={**body, "stream": False})
            assert refused.status_code == 503
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stderr.read().decode() if proc.stderr else ""
    assert '"path": "/v1/chat/completions"' in log and "draining" in log
