"""The public gRPC TextGeneration API through a plain Python gRPC client, plus grpc.health.v1."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from gateway.tokenizer import Tokenizer
from services.config import SecurityConfig
from services.grpc_utils import check_health, sync_channel
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from tests.gateway.conftest import ANSWER, API_KEY, Stack
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine

pytestmark = pytest.mark.slow
HELLO = [pb.ChatMessage(role="user", content="Say hello.")]


@pytest.fixture
def stub(stack: Stack) -> Iterator[pb_grpc.TextGenerationStub]:
    """A client sending the gateway's API key (`authorization: Bearer` metadata)."""
    with sync_channel(stack.grpc_address, security=SecurityConfig(token=API_KEY)) as channel:
        yield pb_grpc.TextGenerationStub(channel)


def test_health_reports_serving(stack: Stack) -> None:
    assert check_health(stack.grpc_address)
    assert check_health(stack.grpc_address, "tessera.v1.TextGeneration")


def test_reflection_lists_the_services(stack: Stack) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with sync_channel(stack.grpc_address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"tessera.v1.TextGeneration", "grpc.health.v1.Health"} <= services


def test_chat_stream(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    chunks = list(stub.ChatStream(pb.ChatRequest(messages=HELLO, request_id="mine-1")))
    assert "".join(c.text for c in chunks) == ANSWER
    assert {c.id for c in chunks} == {"mine-1"}
    assert [c.finish_reason for c in chunks][-1] == "stop"
    assert all(not c.HasField("usage") for c in chunks[:-1])
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(
        tokenizer.encode_chat([{"role": "user", "content": "Say hello."}])
    )
    assert usage.completion_tokens == len(engine.answer_ids) + 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_unary_with_stop_and_params(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine
) -> None:
    params = pb.TextSamplingParams(stop=["naïve"], temperature=0.0, seed=5, top_k=3)
    reply = stub.Chat(pb.ChatRequest(model=MODEL_NAME, messages=HELLO, params=params, priority=2))
    assert reply.text == ANSWER[: ANSWER.index("naïve")] and reply.finish_reason == "stop"
    assert reply.model == MODEL_NAME and reply.id.startswith("chatcmpl-")
    (request,) = engine.requests
    assert request.sampling_params.seed == 5 and request.sampling_params.temperature == 0.0
    assert request.sampling_params.top_k == 3 and request.priority == 2


def test_complete_and_complete_stream(stub: pb_grpc.TextGenerationStub, engine: FakeEngine) -> None:
    params = pb.TextSamplingParams(max_tokens=3)
    reply = stub.Complete(pb.CompletionRequest(prompt="Once", params=params))
    assert reply.finish_reason == "length" and reply.usage.completion_tokens == 3
    chunks = list(stub.CompleteStream(pb.CompletionRequest(prompt="Once", params=params)))
    assert "".join(c.text for c in chunks) == reply.text


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.ChatRequest(messages=HELLO, params=pb.TextSamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ChatRequest(messages=[]), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ChatRequest(messages=[pb.ChatMessage(role="wizard", content="x")]), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ChatRequest(messages=HELLO, params=pb.TextSamplingParams(max_tokens=10**6)), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ChatRequest(model="gpt-9", messages=HELLO), grpc.StatusCode.NOT_FOUND),
    ],
)  # fmt: skip
def test_errors_are_grpc_statuses(
    stub: pb_grpc.TextGenerationStub,
    engine: FakeEngine,
    request_: pb.ChatRequest,
    code: grpc.StatusCode,
) -> None:
    for call in (stub.Chat, lambda r: list(stub.ChatStream(r))):
        with pytest.raises(grpc.RpcError) as info:
            call(request_)
        assert info.value.code() == code, info.value.details()
    assert engine.requests == []
    assert stub.Chat(pb.ChatRequest(messages=HELLO)).text == ANSWER  # still serving


def test_list_models_and_tokenize(stub: pb_grpc.TextGenerationStub, tokenizer: Tokenizer) -> None:
    (card,) = stub.ListModels(pb.ListModelsRequest()).models
    assert card.id == MODEL_NAME and card.max_model_len == 512
    reply = stub.Tokenize(pb.TokenizeRequest(text="héllo 😀"))
    assert list(reply.token_ids) == tokenizer.encode("héllo 😀") and reply.count == len(
        reply.token_ids
    )
    chat = stub.Tokenize(pb.TokenizeRequest(messages=HELLO))
    assert list(chat.token_ids) == tokenizer.encode_chat(
        [{"role": "user", "content": "Say hello."}]
    )


def test_cancelled_stream_aborts_the_engine_request(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine
) -> None:
    engine.token_delay_s = 0.05
    call = stub.ChatStream(pb.ChatRequest(messages=HELLO))
    next(call)
    cancelled_at = time.monotonic()
    call.cancel()
    deadline = time.monotonic() + 3
    while not engine.cancelled_at and time.monotonic() < deadline:
        time.sleep(0.005)
    # Behavioural, not a latency budget: the engine request was cut (cancelled_at is only set
    # for a request that did not finish) before its answer could have ended by itself.
    assert engine.cancelled_at
    answer_s = len(engine.answer_ids) * engine.token_delay_s
    assert next(iter(engine.cancelled_at.values())) - cancelled_at < answer_s
