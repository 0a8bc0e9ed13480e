"""Acceptance 3: 200 image requests through `tessera serve` (tiny LLaVA, shm handles), 30%
of the clients dropping mid-stream, and the worker SIGKILLed during the run, leave no
shared-memory segment of the gateway behind and no KV block in use."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.stack import Stack, start_stack
from benchmarks.tiny_vlm import build_tiny_llava, png_bytes, sample_image
from tests.stack.test_serve_e2e import scheduler_stats

pytestmark = pytest.mark.slow
NUM_REQUESTS = 200
KILL_AFTER = 120  # requests finished before the worker is killed
CONCURRENCY = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Stack]:
    model_dir = build_tiny_llava(tmp_path_factory.mktemp("llava"), default_model_dir)
    stack = start_stack("--model", str(model_dir), "--dtype", "float32")
    yield stack
    stack.stop()


def _segments(pid: int) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"tessera_{pid}_")}


def _body(i: int, model: str) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(sample_image(i % 7))).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "stream": True,
        "ignore_eos": True,
    }


async def _one(client: httpx.AsyncClient, model: str, i: int, done: list[int]) -> str:
    """'ok', 'dropped' (the client left after the first chunk) or 'failed'."""
    drop = i % 10 < 3
    try:
        async with client.stream("POST", "/v1/chat/completions", json=_body(i, model)) as reply:
            if reply.status_code != 200:
                return "failed"
            async for line in reply.aiter_lines():
                if drop and line.startswith("data:"):
                    return "dropped"  # leaving the block closes the connection mid-stream
                if '"error"' in line:
                    return "failed"
        return "ok"
    except httpx.HTTPError:
        return "failed"
    finally:
        done.append(i)


async def _run(stack: Stack, kill: Any) -> list[str]:
    done: list[int] = []
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def limited(client: httpx.AsyncClient, model: str, i: int) -> str:
        async with semaphore:
            if i == KILL_AFTER + CONCURRENCY:
                kill()
            return await _one(client, model, i, done)

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        runs = (limited(client, model, i) for i in range(NUM_REQUESTS))
        return list(await asyncio.gather(*runs))


def test_no_segment_and_no_block_left(stack: Stack) -> None:
    pids = stack.service_pids()
    gateway = pids["gateway"]
    before = _segments(gateway)
    killed: list[float] = []

    def kill() -> None:
        os.kill(pids["worker_service"], signal.SIGKILL)
        killed.append(time.monotonic())

    seen: set[str] = set()  # segments observed while the run goes on
    running = threading.Event()
    running.set()

    def watch() -> None:
        while running.is_set():
            seen.update(_segments(gateway))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = asyncio.run(_run(stack, kill))
    finally:
        running.clear()
        watcher.join(5)
    assert len(seen - before) >= 10, "the gateway sent no shm handles"
    assert killed, "the worker was never killed"
    assert results.count("ok") >= KILL_AFTER * 0.6, results
    assert results.count("dropped") >= 30 and "failed" in results  # the kill failed some
    deadline = time.monotonic() + 30
    while _segments(gateway) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _segments(gateway) - before == set()
    stats = scheduler_stats(stack)
    while (stats.num_blocks_used or stats.num_running) and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = scheduler_stats(stack)
    assert stats.num_blocks_used == 0 and stats.num_running == 0
