"""The gateway while its scheduler is down: an open stream ends with an error event, new
requests get 503 + Retry-After (REST, official openai client) and UNAVAILABLE (gRPC text API)
within a second, and once a scheduler answers again on the same address the gateway
reconnects by itself."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import openai
import pytest

from gateway.tokenizer import Tokenizer
from services.grpc_utils import GrpcServer, Registration, sync_channel
from services.pb import engine_pb2_grpc
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from tests.gateway.conftest import ANSWER, Stack, start_stack
from tests.gateway.fake_engine import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
T = TypeVar("T")
HELLO: Any = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def own_stack(tokenizer: Tokenizer) -> Iterator[Stack]:
    """A stack of its own: the test stops its engine."""
    s = start_stack(tokenizer)
    yield s
    s.stop()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def _on_loop(stack: Stack, coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, stack.loop).result(10)


def _restart_engine(stack: Stack, port: int) -> GrpcServer:
    async def start() -> GrpcServer:
        registration = Registration(
            "tessera.v1.EngineCore", engine_pb2_grpc.add_EngineCoreServicer_to_server, stack.engine
        )
        server = GrpcServer(f"127.0.0.1:{port}", [registration])
        await server.start()
        await server.set_serving(True)
        return server

    return _on_loop(stack, start())


def test_scheduler_down_then_back(own_stack: Stack) -> None:
    stack, client = own_stack, _client(own_stack)
    port = stack.engine_server.port
    stack.engine.token_delay_s = 0.3  # the stream is still open when the engine goes away
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=HELLO,
        stream=True,
    )
    first = next(iter(stream))
    assert first.choices[0].delta is not None
    outcome: dict[str, Any] = {}

    def drain() -> None:
        try:
            for _ in stream:
                pass
            outcome["ended"] = "cleanly"
        except openai.APIError as exc:  # the SSE error event
            outcome["ended"] = exc.message
        outcome["at"] = time.monotonic()

    reader = threading.Thread(target=drain)
    reader.start()
    killed_at = time.monotonic()
    _on_loop(stack, stack.engine_server.stop(0))
    reader.join(10)
    assert "unavailable" in str(outcome["ended"]), outcome
    assert float(outcome["at"]) - killed_at < 2.0

    for _ in range(3):  # REST: 503 with Retry-After, at once, in OpenAI's shape
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as excinfo:
            client.chat.completions.create(model=MODEL_NAME, messages=HELLO)
        assert time.monotonic() - start < 1.0
        assert excinfo.value.status_code == 503
        assert excinfo.value.response.headers["retry-after"] == "1"
        assert excinfo.value.response.json()["error"]["code"] == "service_unavailable"
    with sync_channel(stack.grpc_address) as channel:  # gRPC text API: UNAVAILABLE at once
        stub = pb_grpc.TextGenerationStub(channel)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as rpc_exc:
            stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(**HELLO[0])]), timeout=10)
        assert rpc_exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 1.0

    stack.engine.token_delay_s = 0.0
    server = _restart_engine(stack, port)
    try:
        deadline, reply = time.monotonic() + 10, None
        while reply is None:
            try:
                reply = client.chat.completions.create(model=MODEL_NAME, messages=HELLO)
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and time.monotonic() < deadline
                time.sleep(0.2)
        assert reply.choices[0].message.content == ANSWER
    finally:
        _on_loop(stack, server.stop(0))
