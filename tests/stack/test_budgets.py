"""Per-request budgets and deadlines through `tessera serve` with the real default model
(issue 25, finding 6; acceptance 4), REST driven by the official openai client: requests
over --max-n, --max-logprobs or --max-request-tokens get a 400 before any engine work; a
request past its deadline is aborted in the scheduler (0 KV blocks used, nothing running or
waiting afterwards) while a concurrent request finishes untouched."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest

from benchmarks.stack import Stack, start_stack
from services.grpc_utils import sync_channel
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from services.step_types import SchedulerStats
from tests.stack.test_serve_e2e import scheduler_stats, wait_idle

pytestmark = pytest.mark.slow
BUDGET = 4096
LIMITS = ("--max-n", "4", "--max-logprobs", "5", "--max-request-tokens", str(BUDGET))
ASK: Any = [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]
LONG = {"max_tokens": 2000, "ignore_eos": True}  # ~a minute on CPU: only a deadline ends it
DEADLINE_S = 0.5
NORMAL_TOKENS = 48


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = start_stack(*LIMITS)
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


@pytest.fixture(scope="module")
def client(stack: Stack) -> Any:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def assert_idle(stack: Stack) -> SchedulerStats:
    stats = wait_idle(stack, 10)
    assert (stats.num_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0), stats
    return stats


def bad_request(client: Any, param: str, **kwargs: Any) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=ASK, **kwargs)
    body: Any = info.value.body
    assert body["param"] == param, body
    return str(body["message"])


def test_over_the_limits_is_400_before_any_engine_work(stack: Stack, client: Any) -> None:
    before = scheduler_stats(stack)
    assert "--max-n" in bad_request(client, "n", n=5, max_tokens=4)
    assert "--max-logprobs" in bad_request(
        client, "top_logprobs", logprobs=True, top_logprobs=6, max_tokens=4
    )
    assert "--max-request-tokens" in bad_request(client, "max_tokens", n=4, max_tokens=1025)
    assert "--max-request-tokens" in bad_request(client, "max_tokens")  # unset: 8192 - prompt
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt="Once", logprobs=6, max_tokens=4)
    body: Any = info.value.body
    assert body["param"] == "logprobs", body
    assert scheduler_stats(stack).num_finished == before.num_finished  # the engine saw none
    reply = client.chat.completions.create(
        model="", messages=ASK, n=4, max_tokens=4, logprobs=True, top_logprobs=5
    )
    assert len(reply.choices) == 4 and len(reply.choices[0].logprobs.content[0].top_logprobs) == 5


def test_deadline_aborts_while_a_concurrent_request_finishes(stack: Stack, client: Any) -> None:
    with ThreadPoolExecutor(1) as pool:
        normal: Future[Any] = pool.submit(
            client.chat.completions.create, model="", messages=ASK, temperature=0,
            max_tokens=NORMAL_TOKENS, extra_body={"ignore_eos": True},
        )  # fmt: skip
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model="", messages=ASK, extra_body={**LONG, "timeout": DEADLINE_S}
            )
        took = time.monotonic() - start
        reply = normal.result(timeout=600)
    body: Any = info.value.body
    assert info.value.status_code == 408 and body["code"] == "timeout", body
    assert DEADLINE_S <= took < DEADLINE_S + 2, took
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == NORMAL_TOKENS
    assert_idle(stack)


def test_deadline_ends_a_stream_with_an_error_event(stack: Stack, client: Any) -> None:
    stream = client.chat.completions.create(
        model="", messages=ASK, stream=True, n=2, extra_body={**LONG, "timeout": DEADLINE_S}
    )
    chunks = 0
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            chunks += 1
    body: Any = info.value.body
    assert chunks > 0 and body["code"] == "timeout", body
    assert_idle(stack)


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_grpc_call_deadline_aborts_the_request(stack: Stack, streaming: bool) -> None:
    request = pb.CompletionRequest(
        prompt="Once upon a time",
        params=pb.TextSamplingParams(max_tokens=LONG["max_tokens"], ignore_eos=True),
    )
    with sync_channel(stack.gateway_grpc_address) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            if streaming:
                list(stub.CompleteStream(request, timeout=DEADLINE_S))
            else:
                stub.Complete(request, timeout=DEADLINE_S)
        took = time.monotonic() - start
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert took < DEADLINE_S + 2, took
    assert_idle(stack)
