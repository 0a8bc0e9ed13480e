"""The API key on every public surface: REST and the gRPC text API; health stays open."""

from __future__ import annotations

import grpc
import httpx
import pytest

from services.config import SecurityConfig
from services.grpc_utils import check_health, sync_channel
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from tests.gateway.conftest import ANSWER, API_KEY, Stack

pytestmark = pytest.mark.slow
KEYS = [None, "wrong-key", API_KEY]
IDS = ["no-key", "wrong-key", "right-key"]
HELLO = [pb.ChatMessage(role="user", content="Say hello.")]


def _headers(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(("key", "status"), list(zip(KEYS, [401, 401, 200], strict=True)), ids=IDS)
def test_rest_matrix(stack: Stack, key: str | None, status: int) -> None:
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        chat = http.post("/v1/chat/completions", json=body, headers=_headers(key))
        tokenize = http.post("/tokenize", json={"prompt": "hi"}, headers=_headers(key))
        models = http.get("/v1/models", headers=_headers(key))
        assert http.get("/health").status_code == 200  # open whatever the key
    assert (chat.status_code, tokenize.status_code, models.status_code) == (status,) * 3
    if status == 401:
        assert chat.json()["error"]["type"]


@pytest.mark.parametrize(
    ("key", "code"),
    list(zip(KEYS, [grpc.StatusCode.UNAUTHENTICATED] * 2 + [grpc.StatusCode.OK], strict=True)),
    ids=IDS,
)
def test_grpc_text_api_matrix(stack: Stack, key: str | None, code: grpc.StatusCode) -> None:
    security = SecurityConfig(token=key or "")
    with sync_channel(stack.grpc_address, security=security) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        calls = {
            "Chat": lambda: stub.Chat(pb.ChatRequest(messages=HELLO), timeout=10),
            "ChatStream": lambda: list(stub.ChatStream(pb.ChatRequest(messages=HELLO), timeout=10)),
            "ListModels": lambda: stub.ListModels(pb.ListModelsRequest(), timeout=10),
            "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10),
        }
        for name, call in calls.items():
            try:
                reply = call()
                got = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                got = exc.code()
            assert got == code, name
            if name == "Chat" and got == grpc.StatusCode.OK:
                assert reply.text == ANSWER
    assert check_health(stack.grpc_address, security=security)  # health open whatever the key
