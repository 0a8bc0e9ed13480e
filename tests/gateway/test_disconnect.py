"""A client that goes away aborts its engine request(s) at once (the gRPC call is cancelled)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx
import pytest

from tests.gateway.conftest import API_KEY, Stack
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine

pytestmark = pytest.mark.slow
ABORT_WITHIN_S = 0.1


def wait_until(predicate: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def body(**fields: object) -> dict[str, object]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}


def metric(stack: Stack, name: str) -> float:
    text = httpx.get(f"{stack.base_url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize("n", [1, 3])
def test_dropped_stream_aborts_engine_requests(stack: Stack, engine: FakeEngine, n: int) -> None:
    engine.token_delay_s = 0.05
    before = metric(stack, "tessera_client_disconnects_total")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(base_url=stack.base_url, headers=headers) as http,
        http.stream("POST", "/v1/chat/completions", json=body(stream=True, n=n)) as response,
    ):
        got = []
        for line in response.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                got.append(line)
            if len(got) == 3:  # a few tokens arrived, nothing cancelled while streaming
                assert not engine.cancelled_at
                dropped_at = time.monotonic()
                break  # leaving the loop closes the line iterator, and with it the connection
        assert len(got) == 3
    wait_until(lambda: len(engine.cancelled_at) == n)
    assert max(engine.cancelled_at.values()) - dropped_at < ABORT_WITHIN_S, engine.cancelled_at
    wait_until(lambda: stack.gateway.serving.in_flight == 0)
    assert metric(stack, "tessera_client_disconnects_total") == before + 1


def test_dropped_non_streaming_request_aborts_engine_request(
    stack: Stack, engine: FakeEngine
) -> None:
    engine.token_delay_s = 0.05
    payload = json.dumps(body()).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", stack.gateway.http_port))
    sock.sendall(head + payload)
    wait_until(lambda: len(engine.started) == 1)
    time.sleep(0.15)  # a few tokens in
    dropped_at = time.monotonic()
    sock.close()
    wait_until(lambda: len(engine.cancelled_at) == 1)
    assert next(iter(engine.cancelled_at.values())) - dropped_at < ABORT_WITHIN_S
    wait_until(lambda: stack.gateway.serving.in_flight == 0)
