"""Health, metrics, tokenize/detokenize, version, CORS and auth scope of the REST app."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.conftest import API_KEY, Stack, start_stack
from tests.gateway.fake_engine import FakeEngine

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, headers=AUTH, timeout=30) as client:
        yield client


def metric_value(text: str, line_prefix: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(line_prefix)]
    return float(line.split()[-1])


def test_health_and_version_need_no_key(stack: Stack) -> None:
    assert httpx.get(f"{stack.base_url}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{stack.base_url}/version").json()
    assert httpx.get(f"{stack.base_url}/v1/models").status_code == 401


def test_metrics_export_gateway_and_scheduler_figures(
    http: httpx.Client, engine: FakeEngine
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    text = http.get("/metrics").text
    assert (
        metric_value(text, 'tessera_http_requests_total{route="/v1/chat/completions",status="200"}')
        >= 1
    )
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert metric_value(text, f"tessera_{name}_seconds_count") >= 1
    assert metric_value(text, "tessera_requests_in_flight ") == 0
    assert metric_value(text, "tessera_scheduler_requests_running ") == 3
    assert metric_value(text, "tessera_scheduler_requests_waiting ") == 2
    assert metric_value(text, "tessera_scheduler_kv_cache_usage ") == 0.25
    assert metric_value(text, "tessera_scheduler_preemptions ") == 7
    assert metric_value(text, "tessera_scheduler_up ") == 1


def test_tokenize_and_detokenize(http: httpx.Client, tokenizer: Tokenizer) -> None:
    reply = http.post("/tokenize", json={"prompt": "héllo 😀 日本"}).json()
    assert reply["tokens"] == tokenizer.encode("héllo 😀 日本") and reply["count"] == len(
        reply["tokens"]
    )
    assert reply["max_model_len"] == 512
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    back = http.post("/detokenize", json={"tokens": reply["tokens"]}).json()
    assert back == {"prompt": "héllo 😀 日本"}


def test_cors_preflight(tokenizer: Tokenizer) -> None:
    stack = start_stack(tokenizer, cors_allow_origins=("https://app.example",), api_key=API_KEY)
    try:
        headers: dict[str, Any] = {
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        reply = httpx.options(f"{stack.base_url}/v1/chat/completions", headers=headers)
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            f"{stack.base_url}/v1/chat/completions", headers={**headers, "Origin": "https://evil"}
        )
        assert other.status_code == 400
    finally:
        stack.stop()
