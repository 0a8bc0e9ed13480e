"""Faults through the full stack: bad requests, a dead worker, SIGTERM draining
(issue 6, acceptance 5 and 8). Each test owns its stack because it breaks it."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from benchmarks.stack import Stack, start_stack

pytestmark = pytest.mark.slow

BAD_REQUESTS: list[tuple[str, Any]] = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct"}),
    ("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct", "messages": [], "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 10**7}),
    ("/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": [10**9]}),
]


def _complete(stack: Stack, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": max_tokens, **extra}
    return httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120)


def _stream_collect(stack: Stack, max_tokens: int, out: dict[str, Any], key: str) -> None:
    """Stream a completion; record the concatenated text and whether it ended cleanly."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    events: list[str] = []
    try:
        with httpx.stream(
            "POST", f"{stack.base_url}/v1/completions", json=body, timeout=120
        ) as reply:
            out[f"{key}:status"] = reply.status_code
            events.extend(line for line in reply.iter_lines() if line.startswith("data: "))
    except httpx.HTTPError as exc:
        out[f"{key}:exception"] = repr(exc)
    out[key] = events


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_bad_requests_then_a_dead_worker() -> None:
    stack = start_stack()
    try:
        for path, body in BAD_REQUESTS:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            reply = httpx.post(f"{stack.base_url}{path}", timeout=30, **kwargs)
            assert 400 <= reply.status_code < 500, (body, reply.status_code, reply.text)
            assert set(reply.json()["error"]) >= {"message", "type", "param", "code"}
            assert _complete(stack).status_code == 200
        results: dict[str, Any] = {}
        streamer = threading.Thread(target=_stream_collect, args=(stack, 3000, results, "inflight"))
        streamer.start()
        time.sleep(2.0)
        os.kill(stack.service_pids()["worker_service"], signal.SIGKILL)
        streamer.join(60)
        assert not streamer.is_alive(), "the in-flight stream hung after the worker died"
        assert any('"error"' in e for e in results["inflight"]) or "inflight:exception" in results
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and httpx.get(f"{stack.base_url}/health", timeout=5).status_code != 503
        ):
            time.sleep(0.5)
        assert httpx.get(f"{stack.base_url}/health", timeout=5).status_code == 503
        assert stack.wait_for_line("worker died", 10), stack.output()[-2000:]
    finally:
        stack.stop()


def test_sigterm_drains_inflight_streams_and_refuses_new_ones() -> None:
    stack = start_stack("--drain-timeout", "60")
    try:
        results: dict[str, Any] = {}
        threads = [  # long enough to be in flight at SIGTERM (a 48-token stream was not)
            threading.Thread(target=_stream_collect, args=(stack, 400, results, f"s{i}"))
            for i in range(10)
        ]
        for t in threads:
            t.start()
        time.sleep(1.5)
        pids = stack.service_pids()
        assert len(pids) == 3
        assert all(t.is_alive() for t in threads), "streams ended before SIGTERM: nothing to drain"
        stack.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = _complete(stack)
        assert refused.status_code == 503, refused.text
        for t in threads:
            t.join(90)
        for i in range(10):
            events = results[f"s{i}"]
            assert results[f"s{i}:status"] == 200 and events[-1] == "data: [DONE]", events[-3:]
            assert not any('"error"' in e for e in events)
        assert stack.process.wait(60) == 0
        assert not [pid for pid in pids.values() if _alive(pid)], "a service outlived tessera serve"
    finally:
        stack.stop()
