"""Images that cost little to send and much to resize (issue 25, finding 2): a 400000x1 PNG
(0.4 Mpx, under --max-image-pixels, a few hundred bytes) once made LLaVA's shortest-edge
resize ask for 32x12,800,000 pixels. A real `python -m gateway` process (tiny LLaVA, tiny
Idefics3) in front of the fake EngineCore must refuse it and its 1x400000 twin over REST and
gRPC within 1 s, its RSS growing by under 100 MB, and serve the next good image."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
from PIL import Image

from benchmarks.stack import REPO, wait_healthy
from benchmarks.tiny_vlm import (
    BUILDERS,
    png_bytes,
    sample_image,
)
from services.config import SecurityConfig
from services.grpc_utils import sync_channel
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from services.security import API_KEY_ENV, TOKEN_ENV
from tests.conftest import free_port
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine, start_fake_engine

pytestmark = pytest.mark.slow
BOMBS = [(400000, 1), (1, 400000)]
MAX_SECONDS = 1.0
MAX_RSS_GROWTH = 100 << 20


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    port: int
    grpc_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _serve_fake_engine() -> tuple[str, Callable[[], None]]:
    """The fake EngineCore on a loop thread: its address and a stop function."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server = asyncio.run_coroutine_threadsafe(
        start_fake_engine(FakeEngine([28, 29, 30])), loop
    ).result(30)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)

    return f"127.0.0.1:{server.port}", stop


def _start_gateway(model_dir: Path, scheduler: str) -> Gateway:
    port, grpc_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "gateway", "--scheduler", scheduler, "--model", str(model_dir),
        "--port", str(port), "--grpc-port", str(grpc_port), "--log-level", "WARNING",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, API_KEY_ENV)}
    process = subprocess.Popen(argv, cwd=REPO, env=env)
    gateway = Gateway(process, port, grpc_port)
    if wait_healthy(process, gateway.base_url, 180, interval_s=0.3):
        return gateway
    process.kill()
    raise RuntimeError("the gateway did not become healthy")


@pytest.fixture(scope="module", params=list(BUILDERS))
def gateway(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> Iterator[Gateway]:
    """A gateway process serving each tiny VLM in turn, warmed by one good image request on
    each API (torch and the processor loaded before anything is measured)."""
    model_dir = BUILDERS[request.param](tmp_path_factory.mktemp(request.param), default_model_dir)
    scheduler, stop_engine = _serve_fake_engine()
    gateway = _start_gateway(model_dir, scheduler)
    try:
        assert _rest(gateway, png_bytes(sample_image(1))).status_code == 200
        assert _grpc(gateway, png_bytes(sample_image(2)))[0] == grpc.StatusCode.OK
        yield gateway
    finally:
        gateway.process.terminate()
        gateway.process.wait(30)
        stop_engine()


def _rest(gateway: Gateway, png: bytes) -> httpx.Response:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
    }
    return httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=60)


def _grpc(gateway: Gateway, png: bytes) -> tuple[grpc.StatusCode, str]:
    """The status of a gRPC Chat with one image, and its details."""
    parts = [pb.ContentPart(text="What is it?"), pb.ContentPart(image=pb.Image(data=png))]
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", parts=parts)])
    with sync_channel(f"127.0.0.1:{gateway.grpc_port}", security=SecurityConfig()) as channel:
        try:
            pb_grpc.TextGenerationStub(channel).Chat(request, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), str(exc.details())
    return grpc.StatusCode.OK, ""


class PeakRss:
    """The largest RSS of a process while the block runs, sampled every 2 ms."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.start = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self) -> PeakRss:
        self.start = self.peak = self.process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        time.sleep(0.05)  # a last sample after the reply
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def _bomb(width: int, height: int) -> bytes:
    png = png_bytes(Image.new("L", (width, height)))
    assert len(png) < 2048 and width * height <= 4096 * 4096  # small, and under the pixel cap
    return png


@pytest.mark.parametrize("api", ["rest", "grpc"])
@pytest.mark.parametrize(("width", "height"), BOMBS, ids=["400000x1", "1x400000"])
def test_extreme_aspect_ratio_is_refused_fast_and_small(
    gateway: Gateway, api: str, width: int, height: int
) -> None:
    png = _bomb(width, height)
    with PeakRss(gateway.process.pid) as rss:
        start = time.monotonic()
        if api == "rest":
            reply = _rest(gateway, png)
            elapsed = time.monotonic() - start
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "aspect ratio over the 200:1 limit" in error["message"]
        else:
            code, details = _grpc(gateway, png)
            elapsed = time.monotonic() - start
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "aspect ratio over the 200:1 limit" in details
    print(f"{api} {width}x{height}: 400 in {elapsed * 1000:.0f} ms, RSS +{rss.growth >> 20} MiB")
    assert elapsed < MAX_SECONDS
    assert rss.growth < MAX_RSS_GROWTH
    assert _rest(gateway, png_bytes(sample_image(3))).status_code == 200  # still serving
