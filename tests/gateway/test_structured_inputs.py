"""Structured-output and tool fields through the live gateway and the fake EngineCore.

Bad constraints and tool definitions are 400s in OpenAI's shape, naming the field, with
nothing queued; good ones reach the engine as one StructuredOutputParams.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.app import version
from gateway.openapi import openapi_document
from tests.gateway.conftest import API_KEY, Stack
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine
from tests.gateway.test_bad_inputs import assert_error_shape

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "hi"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": PERSON}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 3, **fields}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


# (case id, body, the param the error names, text the message must hold)
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("schema-bad-type", chat(response_format=schema_format({"type": "foo"})), "response_format", "foo"),
    ("schema-missing", chat(response_format={"type": "json_schema"}), "response_format", "json_schema"),
    ("format-unknown", chat(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    ("schema-not-object", chat(response_format=schema_format([1])), "response_format.json_schema.schema", "object"),
    ("guided-json-not-json", chat(guided_json="{not json"), "guided_json", "guided_json"),
    ("guided-regex-invalid", chat(guided_regex="(unclosed"), "guided_regex", "guided_regex"),
    ("so-regex-invalid", chat(structured_outputs={"regex": "[a-"}), "structured_outputs", "regex"),
    ("so-two-constraints", chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    ("so-none", chat(structured_outputs={}), "structured_outputs", "exactly one"),
    ("so-empty-choice", chat(structured_outputs={"choice": []}), "structured_outputs.choice", "empty"),
    ("guided-choice-empty", chat(guided_choice=[]), "guided_choice", "empty"),
    ("grammar-invalid", chat(guided_grammar="start: ((("), "guided_grammar", "guided_grammar"),
    ("two-constraints", chat(response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex", "at most one"),
    ("tool-choice-unknown", chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    ("tool-choice-no-tools", chat(tool_choice="required"), "tool_choice", "requires 'tools'"),
    ("tool-choice-bad-string", chat(tools=[TOOL], tool_choice="always"), "tool_choice", "tool_choice"),
    ("tool-no-function", chat(tools=[{"type": "function"}]), "tools[0].function", "required"),
    ("tool-bad-type", chat(tools=[{"type": "retrieval", "function": TOOL["function"]}]), "tools[0].type", "function"),
    ("tool-bad-name", chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name", "pattern"),
    ("tool-params-list", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), "tools[0].function.parameters", "object"),
    ("tool-params-invalid", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]), "tools[0].function.parameters", "foo"),
    ("tool-unknown-field", chat(tools=[{**TOOL, "cache": True}]), "tools[0].cache", "not supported"),
    ("tools-and-format", chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}), "tool_choice", "cannot be combined"),
    ("tool-call-no-id", chat(messages=[{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), "messages[0].tool_calls[0].id", "required"),
    ("top-logprobs-alone", chat(top_logprobs=2), "top_logprobs", "logprobs"),
    ("store-true", chat(store=True), "store", "store"),
    ("service-tier-flex", chat(service_tier="flex"), "service_tier", "service_tier"),
    ("not-implemented-field", chat(functions=[{"name": "f"}]), "functions", "not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body", "param", "needle"), BAD, ids=[c[0] for c in BAD])
def test_bad_constraint_is_a_400_and_nothing_is_queued(
    stack: Stack, engine: FakeEngine, case: str, body: dict[str, Any], param: str, needle: str
) -> None:
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, headers=AUTH)
    assert_error_shape(response, 400, needle)
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert engine.requests == []


# (case id, request fields, the StructuredOutputParams fields the engine must get)
GOOD: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("json-object", {"response_format": {"type": "json_object"}}, {"json_object": True}),
    ("json-schema", {"response_format": schema_format(PERSON)}, {"json": json.dumps(PERSON)}),
    ("text", {"response_format": {"type": "text"}}, {}),
    ("so-json-text", {"structured_outputs": {"json": json.dumps(PERSON)}}, {"json": json.dumps(PERSON)}),
    ("so-json-object", {"structured_outputs": {"json": PERSON}}, {"json": json.dumps(PERSON)}),
    ("so-regex", {"structured_outputs": {"regex": "[0-9]{3}"}}, {"regex": "[0-9]{3}"}),
    ("so-choice", {"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ("yes", "no")}),
    ("guided-json", {"guided_json": PERSON}, {"json": json.dumps(PERSON)}),
    ("guided-regex", {"guided_regex": "a+b"}, {"regex": "a+b"}),
    ("guided-choice", {"guided_choice": ["x", "y"]}, {"choice": ("x", "y")}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "fields", "expected"), GOOD, ids=[c[0] for c in GOOD])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_constraint_reaches_the_engine(
    stack: Stack, engine: FakeEngine, case: str, fields: dict[str, Any], expected: Any, path: str
) -> None:
    body = {**fields, "model": MODEL_NAME, "max_tokens": 3, "n": 2}
    body.update({"messages": USER} if "chat" in path else {"prompt": "hi"})
    response = httpx.post(f"{stack.base_url}{path}", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    assert len(engine.requests) == 2  # every choice carries the constraint
    for request in engine.requests:
        got = request.sampling_params.structured_output
        if not expected:
            assert got is None
            continue
        assert got is not None
        assert {k: getattr(got, k) for k in expected} == expected


def test_openapi_documents_the_new_fields() -> None:
    document = openapi_document(version())
    schemas = document["components"]["schemas"]
    chat_fields = schemas["ChatCompletionRequest"]["properties"]
    for name in ("response_format", "tools", "tool_choice", "parallel_tool_calls", "guided_json"):
        assert name in chat_fields
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is False
    assert "tool_calls" in schemas["AssistantMessage"]["properties"]
    assert document["openapi"].startswith("3.1")
