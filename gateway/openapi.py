"""GET /openapi.json: the OpenAPI 3.1 document, generated from the pydantic models.

Request bodies come from gateway.protocol (what the gateway validates), response bodies
from gateway.schemas; only the routes and their status codes are listed here.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from gateway import protocol as p
from gateway import schemas as s
from gateway.embeddings import EmbeddingRequest

Schema = dict[str, Any]
REQUESTS: tuple[type[BaseModel], ...] = (
    p.ChatCompletionRequest,
    p.CompletionRequest,
    EmbeddingRequest,
    p.TokenizeRequest,
    p.DetokenizeRequest,
)
RESPONSES: tuple[type[BaseModel], ...] = (
    s.ErrorResponse,
    s.ChatCompletion,
    s.ChatCompletionChunk,
    s.Completion,
    s.EmbeddingList,
    s.ModelList,
    s.TokenizeResponse,
    s.DetokenizeResponse,
    s.HealthResponse,
    s.VersionResponse,
)
# One server-sent event (`schema` describes each event): its data is a JSON chunk
# (ChatCompletionChunk or Completion), a JSON error object, or the final "[DONE]".
SSE_EVENT: Schema = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
_ERRORS = {
    "400": "Malformed or invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "408": "The request ran past its deadline and was aborted",
    "413": "Body too large",
    "429": "Too many requests in flight",
    "503": "The engine is unavailable or the server is draining",
    "500": "The engine failed the request",
}


_GENERATE_ERRORS = ("400", "401", "404", "408", "413", "429", "503")


@functools.cache
def _schemas() -> tuple[dict[str, Schema], Schema]:
    """(model name -> $ref, components.schemas)."""
    pairs: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "validation") for m in REQUESTS]
    pairs += [(m, "serialization") for m in RESPONSES]
    refs, defs = models_json_schema(pairs, ref_template="#/components/schemas/{model}")
    return {model.__name__: refs[(model, mode)] for model, mode in pairs}, defs["$defs"]


def _json(name: str) -> Schema:
    return {"application/json": {"schema": _schemas()[0][name]}}


def _errors(*codes: str) -> Schema:
    return {c: {"description": _ERRORS[c], "content": _json("ErrorResponse")} for c in codes}


def _post(
    summary: str, request: str, response: str, stream: bool, errors: tuple[str, ...] | None = None
) -> Schema:
    content = _json(response)
    if stream:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    ok = {"description": "OK (an SSE stream when stream is true)", "content": content}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {"200": ok, **_errors(*(errors or _GENERATE_ERRORS))},
        }
    }


def _get(summary: str, content: Schema, *errors: str) -> Schema:
    responses = {"200": {"description": "OK", "content": content}, **_errors(*errors)}
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(version: str) -> Schema:
    """The OpenAPI 3.1 document of every route."""
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tessera gateway", "version": version},
        "paths": {
            "/v1/chat/completions": _post(
                "Chat completion", "ChatCompletionRequest", "ChatCompletion", True
            ),
            "/v1/completions": _post("Text completion", "CompletionRequest", "Completion", True),
            "/v1/embeddings": _post(
                "Embeddings (a server started with --runner pooling)",
                "EmbeddingRequest",
                "EmbeddingList",
                False,
                (*_GENERATE_ERRORS, "500"),
            ),
            "/v1/models": _get("List models", _json("ModelList"), "401", "503"),
            "/health": _get("200 while the engine serves", _json("HealthResponse"), "503"),
            "/metrics": _get("Prometheus metrics", text),
            "/tokenize": _post("Tokenize", "TokenizeRequest", "TokenizeResponse", False),
            "/detokenize": _post("Detokenize", "DetokenizeRequest", "DetokenizeResponse", False),
            "/version": _get("Server version", _json("VersionResponse")),
            "/openapi.json": _get("This document", {"application/json": {"schema": {}}}),
        },
        "components": {"schemas": _schemas()[1]},
    }
