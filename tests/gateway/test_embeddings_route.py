"""POST /v1/embeddings against a generate-runner engine (the fake EngineCore): a clear 400,
bad bodies refused in OpenAI's shape before any engine call, the route in /openapi.json."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from gateway.app import version
from gateway.openapi import openapi_document
from tests.gateway.conftest import API_KEY, Stack
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_a_generate_server_refuses_embeddings(client: openai.OpenAI, engine: FakeEngine) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL_NAME, input=["hello"])
    body: Any = info.value.body
    assert body["param"] == "model" and "--runner pooling" in body["message"]
    assert engine.requests == []


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"input": []}, "input", "empty list"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["a", ""]}, "input", "empty string"),
        ({"input": [[]]}, "input", "empty"),
        ({"input": [1, "a"]}, "input", ""),
        ({"input": [-1]}, "input", ""),
        ({"input": 5}, "input", ""),
        ({}, "input", "required"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "a", "dimensions": 0}, "dimensions", ""),
        ({"input": "a", "dimensions": "8"}, "dimensions", ""),
        ({"input": "a", "truncate": True}, "truncate", ""),
        ({"input": ["a"] * 2049}, "input", "2048"),
    ],
)
def test_bad_bodies_are_400s(
    stack: Stack, engine: FakeEngine, body: dict[str, Any], param: str, text: str
) -> None:
    reply = httpx.post(
        f"{stack.base_url}/v1/embeddings", json={"model": MODEL_NAME, **body}, headers=AUTH
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error
    assert text in error["message"]
    assert engine.requests == []


def test_unknown_model_is_404_as_on_completions(stack: Stack, engine: FakeEngine) -> None:
    for path, body in (
        ("/v1/embeddings", {"input": "a"}),
        ("/v1/completions", {"prompt": "a"}),
    ):
        reply = httpx.post(f"{stack.base_url}{path}", json={"model": "nope", **body}, headers=AUTH)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_openapi_lists_embeddings() -> None:
    route = openapi_document(version())["paths"]["/v1/embeddings"]["post"]
    assert route["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EmbeddingRequest"
    }
    assert {"200", "400", "404"} <= set(route["responses"])
