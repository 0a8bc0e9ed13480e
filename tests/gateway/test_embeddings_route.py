"""POST /v1/embeddings against the fake EngineCore: of a generate-runner engine a clear 400,
bad bodies refused in OpenAI's shape before any engine call, the route in /openapi.json; of a
pooling one the response shapes (float, base64, token ids), a disconnect aborting every
input's engine call, an engine failure as a 500."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.app import version
from gateway.openapi import openapi_document
from gateway.tokenizer import Tokenizer
from services.types import PoolingParams
from tests.gateway.conftest import API_KEY, Stack, start_stack
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine, fake_vector
from tests.gateway.test_disconnect import wait_until

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


@pytest.fixture(scope="module")
def pooling_stack(tokenizer: Tokenizer) -> Iterator[Stack]:
    """A gateway in front of a fake engine that reports the pooling runner."""
    s = start_stack(tokenizer, runner="pooling", api_key=API_KEY)
    yield s
    s.stop()


@pytest.fixture
def pooling(pooling_stack: Stack) -> FakeEngine:
    pooling_stack.engine.reset()
    return pooling_stack.engine


def test_shapes_of_float_base64_and_token_inputs(
    pooling_stack: Stack, pooling: FakeEngine, tokenizer: Tokenizer
) -> None:
    client = openai.OpenAI(base_url=f"{pooling_stack.base_url}/v1", api_key=API_KEY, max_retries=0)
    texts = ["hello world", "a second, longer input text"]
    reply = client.embeddings.create(model=MODEL_NAME, input=texts)
    ids = [tokenizer.encode(t) for t in texts]
    assert [d.embedding for d in reply.data] == [fake_vector(i) for i in ids]
    assert [d.index for d in reply.data] == [0, 1] and reply.model == MODEL_NAME
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    assert [r.prompt_token_ids for r in pooling.requests] == ids
    assert all(r.pooling_params == PoolingParams() for r in pooling.requests)
    encoded = client.embeddings.create(
        model=MODEL_NAME, input=[[9, 8, 7]], encoding_format="base64"
    )
    raw = base64.b64decode(str(encoded.data[0].embedding))
    assert list(struct.unpack("<4f", raw)) == fake_vector([9, 8, 7])
    vllm_field = httpx.post(
        f"{pooling_stack.base_url}/v1/embeddings",
        json={"input": [5, 6], "normalize": False},
        headers=AUTH,
    ).json()
    assert vllm_field["data"][0]["embedding"] == fake_vector([5, 6])
    assert pooling.requests[-1].pooling_params == PoolingParams(normalize=False)
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model=MODEL_NAME, input="hi", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.completions.create(model=MODEL_NAME, prompt="hi")


def test_a_client_that_goes_away_aborts_every_input(
    pooling_stack: Stack, pooling: FakeEngine
) -> None:
    pooling.token_delay_s = 5.0  # the engine never answers in time
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{pooling_stack.base_url}/v1/embeddings",
            json={"input": ["a", "b", "c"]},
            headers=AUTH,
            timeout=0.5,
        )
    wait_until(lambda: len(pooling.cancelled_at) == 3)


def test_an_engine_failure_is_a_500_in_openai_shape(
    pooling_stack: Stack, pooling: FakeEngine
) -> None:
    pooling.fail_after = 0
    reply = httpx.post(
        f"{pooling_stack.base_url}/v1/embeddings", json={"input": ["a", "b"]}, headers=AUTH
    )
    assert reply.status_code == 500 and reply.json()["error"]["message"] == "boom"
