"""Per-request budgets and deadlines (issue 25, finding 6) over a live gateway on the fake engine:
--max-n, --max-logprobs and --max-request-tokens refuse a request with a 400 naming the field
before the engine sees it; a request past its deadline (--request-timeout, its `timeout` field,
the gRPC call deadline: the shortest wins) is aborted in the engine and answered 408 /
DEADLINE_EXCEEDED. The real-model version, with KV blocks counted, is
tests/stack/test_budgets.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import httpx
import openai
import pytest

from gateway.__main__ import config_from_args
from gateway.__main__ import parse_args as gateway_args
from gateway.tokenizer import Tokenizer
from services.config import RequestLimits, SecurityConfig
from services.grpc_utils import sync_channel
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from tessera.cli import build_parser, build_services, main
from tests.gateway.conftest import API_KEY, Stack, start_stack
from tests.gateway.fake_engine import MAX_MODEL_LEN, MODEL_NAME, FakeEngine
from tests.gateway.test_disconnect import metric, wait_until

pytestmark = pytest.mark.slow
LIMITS = RequestLimits(max_n=4, max_logprobs=5, max_request_tokens=100)
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
SLOW_TOKEN_S = 0.2  # the fake answer (~20 tokens) then takes ~4 s
DEADLINE_S = 0.4
ABORTED_WITHIN_S = 0.3  # from the deadline to the engine's abort


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer) -> Iterator[Stack]:
    s = start_stack(tokenizer, api_key=API_KEY, limits=LIMITS)
    yield s
    s.stop()


@pytest.fixture
def http(stack: Stack, engine: FakeEngine) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=30) as client:
        yield client


@pytest.fixture
def stub(stack: Stack) -> Iterator[pb_grpc.TextGenerationStub]:
    with sync_channel(stack.grpc_address, security=SecurityConfig(token=API_KEY)) as channel:
        yield pb_grpc.TextGenerationStub(channel)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(response: httpx.Response, param: str, needle: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert error["type"] == "invalid_request_error"


# -- limits: 400 before the engine ----------------------------------------------------------


def test_n_over_the_limit_is_refused(http: httpx.Client, engine: FakeEngine) -> None:
    refused(
        http.post(CHAT, json=chat(n=5, max_tokens=4)), "n", "at most 4 on this server (--max-n)"
    )
    refused(http.post(CMPL, json={"prompt": "hi", "n": 5, "max_tokens": 4}), "n", "--max-n")
    assert http.post(CHAT, json=chat(n=4, max_tokens=4)).status_code == 200
    assert len(engine.requests) == 4  # only the allowed request's 4 choices reached the engine


def test_logprobs_over_the_limit_are_refused(http: httpx.Client, engine: FakeEngine) -> None:
    over = chat(logprobs=True, top_logprobs=6, max_tokens=4)
    refused(http.post(CHAT, json=over), "top_logprobs", "at most 5 on this server (--max-logprobs)")
    body = {"prompt": "hi", "logprobs": 6, "max_tokens": 4}
    refused(http.post(CMPL, json=body), "logprobs", "--max-logprobs")
    assert http.post(CMPL, json={**body, "logprobs": 5}).status_code == 200
    assert len(engine.requests) == 1


def test_token_budget_counts_n_times_max_tokens(http: httpx.Client, engine: FakeEngine) -> None:
    refused(http.post(CHAT, json=chat(n=2, max_tokens=51)), "max_tokens", "up to 102 tokens")
    two_prompts = {"prompt": ["a", "b"], "n": 2, "max_tokens": 26}  # 2 x 2 x 26 = 104
    refused(http.post(CMPL, json=two_prompts), "max_tokens", "--max-request-tokens")
    assert not engine.requests
    assert http.post(CHAT, json=chat(n=2, max_tokens=50)).status_code == 200


def test_unset_max_tokens_counts_as_the_context_left(
    http: httpx.Client, engine: FakeEngine
) -> None:
    reply = http.post(CHAT, json=chat())  # up to MAX_MODEL_LEN - prompt > 100
    refused(reply, "max_tokens", "budget of 100 tokens per request")
    assert not engine.requests


def test_grpc_token_budget_is_invalid_argument(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine
) -> None:
    hello = [pb.ChatMessage(role="user", content="hi")]
    with pytest.raises(grpc.RpcError) as info:
        stub.Chat(pb.ChatRequest(messages=hello))  # max_tokens unset: the context left
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-request-tokens" in (info.value.details() or "")
    assert not engine.requests
    params = pb.TextSamplingParams(max_tokens=8)
    assert stub.Chat(pb.ChatRequest(messages=hello, params=params)).text


def test_limits_allow_what_the_defaults_allow() -> None:
    limits = RequestLimits()
    assert (limits.max_n, limits.max_logprobs, limits.request_timeout_s) == (16, 20, 0.0)
    assert limits.max_request_tokens >= limits.max_n * 8192  # n=16 at the default model's context
    assert limits.timeout_s(None) is None and limits.timeout_s(2.5) == 2.5
    assert replace(limits, request_timeout_s=1.0).timeout_s(None) == 1.0
    assert replace(limits, request_timeout_s=1.0).timeout_s(5.0) == 1.0  # the shorter wins
    for bad in ({"max_n": 0}, {"max_n": 65}, {"max_logprobs": 21}, {"request_timeout_s": -1}):
        with pytest.raises(ValueError):
            RequestLimits(**bad)
    assert LIMITS.max_request_tokens < MAX_MODEL_LEN  # the unset-max_tokens test needs it


def test_tessera_serve_passes_the_limits_to_the_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--max-n", "8", "--max-logprobs", "3", "--max-request-tokens", "1000"]
    for argv, want in (
        ([], RequestLimits()),
        ([*flags, "--request-timeout", "2.5"], RequestLimits(8, 3, 1000, 2.5)),
    ):
        gateway = build_services(build_parser().parse_args(["serve", *argv]), "token")[-1]
        args = gateway_args(gateway.argv[3:])  # [python, -m, gateway, ...]
        assert config_from_args(args).limits == want
    assert main(["serve", "--max-n", "65"]) == 2  # refused before any service starts
    assert "max_n must be in [1, 64]" in capsys.readouterr().err


# -- deadlines: aborted in the engine, 408 / DEADLINE_EXCEEDED ------------------------------


def test_deadline_aborts_a_plain_request_with_408(
    stack: Stack, http: httpx.Client, engine: FakeEngine
) -> None:
    engine.token_delay_s = SLOW_TOKEN_S
    before = metric(stack, "tessera_request_timeouts_total")
    start = time.monotonic()
    reply = http.post(CHAT, json=chat(max_tokens=50, timeout=DEADLINE_S))
    assert reply.status_code == 408, reply.text
    assert reply.json()["error"]["code"] == "timeout"
    assert reply.json()["error"]["type"] == "timeout_error"
    assert reply.headers["x-should-retry"] == "false"
    assert DEADLINE_S <= time.monotonic() - start < DEADLINE_S + 1.0
    wait_until(lambda: len(engine.cancelled()) == 1)
    assert next(iter(engine.cancelled().values())) - start < DEADLINE_S + ABORTED_WITHIN_S
    assert metric(stack, "tessera_request_timeouts_total") == before + 1
    wait_until(lambda: stack.gateway.serving.in_flight == 0)


def test_openai_client_sees_408_and_does_not_retry(stack: Stack, engine: FakeEngine) -> None:
    engine.token_delay_s = SLOW_TOKEN_S
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY)  # 2 retries
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=50,
            extra_body={"timeout": DEADLINE_S},
        )  # fmt: skip
    assert info.value.status_code == 408
    assert len(engine.requests) == 1  # x-should-retry: false kept the SDK from retrying
    wait_until(lambda: len(engine.cancelled()) == 1)


def test_deadline_ends_a_stream_with_an_error_event(
    stack: Stack, http: httpx.Client, engine: FakeEngine
) -> None:
    engine.token_delay_s = 0.2  # 50 tokens take 10 s; the first few fit the 1.5 s deadline
    with http.stream(  # (a deadline of 0.5 s missed the first tokens on a loaded CI machine)
        "POST", CHAT, json=chat(stream=True, n=2, max_tokens=50, timeout=1.5)
    ) as reply:
        assert reply.status_code == 200  # the first tokens came in time
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "timeout"
    assert sum('"content"' in e for e in events) >= 2
    wait_until(lambda: len(engine.cancelled()) == 2)  # both choices aborted


def test_server_timeout_applies_and_the_shorter_wins(
    stack: Stack, http: httpx.Client, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.token_delay_s = SLOW_TOKEN_S
    monkeypatch.setattr(stack.gateway.serving, "limits", replace(LIMITS, request_timeout_s=0.3))
    for fields in ({}, {"timeout": 30.0}):
        start = time.monotonic()
        reply = http.post(CHAT, json=chat(max_tokens=50, **fields))
        assert reply.status_code == 408, reply.text
        assert "deadline of 0.3 s" in reply.json()["error"]["message"]
        assert time.monotonic() - start < 1.5
    wait_until(lambda: len(engine.cancelled()) == 2)  # the aborts reach the engine after the 408
    engine.token_delay_s = 0.0
    assert http.post(CHAT, json=chat(max_tokens=50)).status_code == 200  # fast ones pass


def test_grpc_call_deadline_aborts_the_request(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine
) -> None:
    engine.token_delay_s = SLOW_TOKEN_S
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hi")],
        params=pb.TextSamplingParams(max_tokens=50),
    )
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.Chat(request, timeout=DEADLINE_S)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as info:
        list(stub.ChatStream(request, timeout=DEADLINE_S))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: len(engine.cancelled()) == 2)
    assert max(engine.cancelled().values()) - start < 2 * DEADLINE_S + ABORTED_WITHIN_S


def test_grpc_server_timeout_is_deadline_exceeded(
    stack: Stack, stub: pb_grpc.TextGenerationStub, engine: FakeEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    engine.token_delay_s = SLOW_TOKEN_S
    monkeypatch.setattr(stack.gateway.serving, "limits", replace(LIMITS, request_timeout_s=0.3))
    request = pb.CompletionRequest(prompt="hi", params=pb.TextSamplingParams(max_tokens=50))
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(request)  # no call deadline: the server's applies
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline of 0.3 s" in (info.value.details() or "")
    wait_until(lambda: len(engine.cancelled()) == 1)
