"""Fuzzing the REST surface over HTTP: random and mutated JSON bodies (and raw bytes)
POSTed to a live gateway backed by the fake engine. Whatever arrives, the answer is
never a 5xx, and every error has OpenAI's shape {"error": {message, type, param, code}}.

Written against the HTTP contract, not the parsing code, so it stays valid whichever
way the request models are implemented.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import API_KEY, Stack, stack, tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow
SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
    },
    "/v1/completions": {"prompt": "Once", "max_tokens": 4},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}  # fmt: skip
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs",
    "echo", "logit_bias", "presence_penalty", "frequency_penalty", "user", "tokens",
    "response_format", "tools", "tool_choice", "min_tokens", "ignore_eos", "best_of",
    "suffix", "add_special_tokens", "content", "role", "priority", "top_k",
]  # fmt: skip
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70), st.integers(-3, 70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["user", "system", "assistant", "tool", "", "\udc80", "auto"]),
)  # fmt: skip
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    """A valid body with fields replaced, removed or added, or something else entirely."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "any-json"]))
    if kind == "any-json":
        return draw(JSON)
    body = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from([*FIELDS, *base]))
        if draw(st.booleans()) and name in body:
            del body[name]
        else:
            body[name] = draw(JSON)
    if draw(st.booleans()) and "messages" in body:  # keep a message, mutate inside it
        message = {"role": "user", "content": draw(JSON)}
        message.update(draw(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=2)))
        body["messages"] = [message]
    return body


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:  # noqa: F811
    with httpx.Client(
        base_url=stack.base_url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as client:
        yield client


def _check(reply: httpx.Response, sent: Any) -> None:
    assert reply.status_code < 500, (reply.status_code, reply.text[:500], sent)
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert isinstance(error["type"], str) and error["type"], error
        assert {"param", "code"} <= error.keys(), error


def _post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8", "surrogatepass")
    with http.stream(
        "POST", path, content=content, headers={"content-type": "application/json"}
    ) as reply:
        reply.read()  # a stream (SSE) is read to its end
    return reply


@SETTINGS
@given(data=st.data())
def test_mutated_json_bodies_never_5xx(http: httpx.Client, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(list(VALID)), label="path")
    body = data.draw(mutated(VALID[path]), label="body")
    _check(_post(http, path, body), body)


@SETTINGS
@given(path=st.sampled_from(list(VALID)), raw=st.binary(max_size=64))
def test_raw_bytes_never_5xx(http: httpx.Client, path: str, raw: bytes) -> None:
    _check(_post(http, path, raw), raw)
