"""Bad requests get the right status and OpenAI's error shape, and the gateway keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import API_KEY, Stack, start_stack
from tests.gateway.fake_engine import MAX_MODEL_LEN, MODEL_NAME, FakeEngine

pytestmark = pytest.mark.slow
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, **fields}


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hi", **fields}


# (case id, method, path, body: bytes | JSON value, headers, status, text the message must hold)
CASES: list[tuple[str, str, str, Any, dict[str, str], int, str]] = [
    ("not-json", "POST", CHAT, b"{not json", AUTH, 400, "not valid JSON"),
    ("json-array", "POST", CHAT, b"[1, 2]", AUTH, 400, "JSON object"),
    ("json-number", "POST", CHAT, b"42", AUTH, 400, "JSON object"),
    ("json-string", "POST", CHAT, b'"hello"', AUTH, 400, "JSON object"),
    ("empty-body", "POST", CHAT, b"", AUTH, 400, "empty"),
    ("nan-literal", "POST", CHAT, b'{"messages": [], "temperature": NaN}', AUTH, 400, "NaN"),
    ("deep-nesting", "POST", CHAT, b"[" * 20000 + b"]" * 20000, AUTH, 400, "JSON"),
    ("invalid-utf8", "POST", CHAT, b'{"messages": "\xff\xfe"}', AUTH, 400, "UTF-8"),
    ("missing-messages", "POST", CHAT, {"model": MODEL_NAME}, AUTH, 400, "messages"),
    ("messages-not-array", "POST", CHAT, chat(messages="hi"), AUTH, 400, "messages"),
    ("empty-messages", "POST", CHAT, chat(messages=[]), AUTH, 400, "non-empty"),
    ("message-not-object", "POST", CHAT, chat(messages=["hi"]), AUTH, 400, "messages[0]"),
    ("bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), AUTH, 400, "role"),
    ("content-number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), AUTH, 400, "content"),
    ("bad-part-type", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]), AUTH, 400, "type"),
    ("image-text-only", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), AUTH, 400, "text-only"),
    ("max-tokens-negative", "POST", CHAT, chat(max_tokens=-1), AUTH, 400, "max_tokens"),
    ("max-tokens-string", "POST", CHAT, chat(max_tokens="10"), AUTH, 400, "integer"),
    ("max-tokens-float", "POST", CHAT, chat(max_tokens=1.5), AUTH, 400, "integer"),
    ("temperature-negative", "POST", CHAT, chat(temperature=-1), AUTH, 400, "temperature"),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), AUTH, 400, "number"),
    ("temperature-bool", "POST", CHAT, chat(temperature=True), AUTH, 400, "number"),
    ("n-zero", "POST", CHAT, chat(n=0), AUTH, 400, "'n'"),
    ("top-p-2", "POST", CHAT, chat(top_p=2), AUTH, 400, "top_p"),
    ("top-k-minus-2", "POST", CHAT, chat(top_k=-2), AUTH, 400, "top_k"),
    ("presence-penalty-3", "POST", CHAT, chat(presence_penalty=3), AUTH, 400, "presence_penalty"),
    ("top-logprobs-21", "POST", CHAT, chat(logprobs=True, top_logprobs=21), AUTH, 400, "top_logprobs"),
    ("stop-number", "POST", CHAT, chat(stop=5), AUTH, 400, "stop"),
    ("stop-mixed-list", "POST", CHAT, chat(stop=["a", 1]), AUTH, 400, "stop"),
    ("logit-bias-key", "POST", CHAT, chat(logit_bias={"abc": 1}), AUTH, 400, "logit_bias"),
    ("logit-bias-value", "POST", CHAT, chat(logit_bias={"5": 1000}), AUTH, 400, "logit_bias"),
    ("logit-bias-vocab", "POST", CHAT, chat(logit_bias={"99999999": 1}), AUTH, 400, "vocabulary"),
    ("stop-token-id-vocab", "POST", CHAT, chat(stop_token_ids=[10**6]), AUTH, 400, "vocabulary"),
    ("stream-string", "POST", CHAT, chat(stream="yes"), AUTH, 400, "boolean"),
    ("stream-options-list", "POST", CHAT, chat(stream=True, stream_options=[1]), AUTH, 400, "stream_options"),
    ("seed-string", "POST", CHAT, chat(seed="7"), AUTH, 400, "seed"),
    ("min-tokens-over-max", "POST", CHAT, chat(max_tokens=2, min_tokens=5), AUTH, 400, "min_tokens"),
    ("context-overflow", "POST", CHAT, chat(max_tokens=100_000), AUTH, 400, str(MAX_MODEL_LEN)),
    ("unknown-model", "POST", CHAT, chat(model="gpt-9"), AUTH, 404, "gpt-9"),
    ("prompt-missing", "POST", CMPL, {"model": MODEL_NAME}, AUTH, 400, "prompt"),
    ("prompt-empty-ids", "POST", CMPL, cmpl(prompt=[[]]), AUTH, 400, "prompt"),
    ("prompt-mixed", "POST", CMPL, cmpl(prompt=[1, "a"]), AUTH, 400, "prompt"),
    ("prompt-id-vocab", "POST", CMPL, cmpl(prompt=[999_999]), AUTH, 400, "vocabulary"),
    ("prompt-too-long", "POST", CMPL, cmpl(prompt=[5] * MAX_MODEL_LEN, max_tokens=1), AUTH, 400, "context length"),
    ("completion-logprobs-21", "POST", CMPL, cmpl(logprobs=21), AUTH, 400, "logprobs"),
    ("echo-string", "POST", CMPL, cmpl(echo="true"), AUTH, 400, "echo"),
    ("oversized-body", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 70_000}]), AUTH, 413, "limit"),
    ("no-api-key", "POST", CHAT, chat(), {}, 401, "API key"),
    ("wrong-api-key", "POST", CHAT, chat(), {"Authorization": "Bearer nope"}, 401, "API key"),
    ("tokenize-empty", "POST", "/tokenize", {}, AUTH, 400, "prompt"),
    ("detokenize-strings", "POST", "/detokenize", {"tokens": ["a"]}, AUTH, 400, "tokens"),
    ("get-on-post-route", "GET", CHAT, None, AUTH, 405, "not allowed"),
    ("unknown-route", "GET", "/v1/nope", None, AUTH, 404, "/v1/nope"),
]  # fmt: skip


@pytest.fixture(scope="module")
def stack(stack_dp: Stack) -> Stack:
    """This suite runs against one engine replica and against two (data parallel)."""
    return stack_dp


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=30) as client:
        yield client


def send(
    http: httpx.Client, method: str, path: str, body: Any, headers: dict[str, str]
) -> httpx.Response:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return http.request(
        method, path, content=content, headers={"Content-Type": "application/json", **headers}
    )


def assert_error_shape(response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and needle in error["message"], error
    assert isinstance(error["type"], str) and error["type"]


def test_at_least_25_cases() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize(
    ("case", "method", "path", "body", "headers", "status", "needle"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_bad_input(
    http: httpx.Client, engine: FakeEngine, case: str, method: str, path: str, body: Any,
    headers: dict[str, str], status: int, needle: str,
) -> None:  # fmt: skip
    assert_error_shape(send(http, method, path, body, headers), status, needle)
    assert engine.requests == []  # nothing reached the engine
    good = send(http, "POST", CHAT, chat(max_tokens=3), AUTH)
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_fields_are_refused_nulls_and_informational_fields_accepted(
    http: httpx.Client, engine: FakeEngine
) -> None:
    refused = send(http, "POST", CHAT, chat(max_tokens=2, frobnicate={"x": 1}), AUTH)
    assert_error_shape(refused, 400, "frobnicate")
    assert refused.json()["error"]["param"] == "frobnicate"
    assert_error_shape(send(http, "POST", CMPL, cmpl(best_of=2), AUTH), 400, "best_of")
    assert_error_shape(send(http, "POST", CHAT, chat(store=True), AUTH), 400, "store")
    assert engine.requests == []
    fine = chat(max_tokens=2, frobnicate=None, user="u1", metadata={"k": "v"}, store=False)
    assert send(http, "POST", CHAT, fine, AUTH).status_code == 200


def test_error_mid_stream_ends_with_error_event_and_done(
    http: httpx.Client, engine: FakeEngine
) -> None:
    engine.fail_after = 3
    response = send(http, "POST", CHAT, chat(stream=True), AUTH)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "boom" in json.loads(events[-2])["error"]["message"]
    assert len(events) > 3  # it did stream before failing
    failed = send(http, "POST", CHAT, chat(), AUTH)  # not streaming: an engine error is a 500
    assert_error_shape(failed, 500, "boom")


def test_request_id_is_echoed(http: httpx.Client) -> None:
    response = http.get("/v1/models", headers={**AUTH, "X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert len(http.get("/version").headers["x-request-id"]) == 32


def test_admission_limit_gives_429(tokenizer: Any) -> None:
    stack = start_stack(tokenizer, max_queued_requests=1)
    try:
        stack.engine.token_delay_s = 0.05
        with httpx.Client(base_url=stack.base_url, timeout=30) as http:
            with http.stream("POST", CHAT, json=chat(stream=True)) as first:
                lines = first.iter_lines()  # keep it: a dropped iterator closes the stream
                next(lines)
                assert_error_shape(send(http, "POST", CHAT, chat(), {}), 429, "too many")
            stack.engine.token_delay_s = 0
            deadline = time.monotonic() + 5  # the slot frees once the server sees the close
            while stack.gateway.serving.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            assert send(http, "POST", CHAT, chat(max_tokens=2), {}).status_code == 200
    finally:
        stack.stop()


def test_engine_down_gives_503(tokenizer: Any) -> None:
    from tests.conftest import free_port

    stack = start_stack(tokenizer, scheduler_address=f"127.0.0.1:{free_port()}")
    try:
        with httpx.Client(base_url=stack.base_url, timeout=30) as http:
            assert_error_shape(send(http, "POST", CHAT, chat(), {}), 503, "unavailable")
            assert_error_shape(http.get("/health"), 503, "not serving")
            assert http.get("/version").status_code == 200
    finally:
        stack.stop()


def test_draining_refuses_new_requests(tokenizer: Any) -> None:
    stack = start_stack(tokenizer, drain_timeout_s=5)
    try:
        stack.engine.token_delay_s = 0.02
        with (
            httpx.Client(base_url=stack.base_url, timeout=30) as http,
            http.stream("POST", CHAT, json=chat(stream=True)) as running,
        ):
            lines = running.iter_lines()
            next(lines)
            stack.loop.call_soon_threadsafe(stack.gateway.start_drain)
            assert_error_shape(send(http, "POST", CHAT, chat(), {}), 503, "shutting down")
            rest = [line for line in lines if line]  # the in-flight stream still finishes
            assert rest[-1] == "data: [DONE]"
        stack.thread.join(5)
        assert not stack.thread.is_alive()  # stopped once the stream was done
    finally:
        stack.stop()
