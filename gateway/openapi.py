"""The hand-written OpenAPI 3.0 document of the gateway's HTTP routes (GET /openapi.json).

Request schemas state the same types and ranges that gateway.protocol checks;
response schemas state the shapes gateway.responses builds.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol import MAX_N, MAX_PROMPTS, MAX_STOP, ROLES
from services.types import MAX_LOGPROBS

Schema = dict[str, Any]
INT: Schema = {"type": "integer"}
STR: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _num(lo: float, hi: float, lo_open: bool = False) -> Schema:
    return {
        "type": "number",
        "minimum": lo,
        "maximum": hi,
        "exclusiveMinimum": lo_open,
        "nullable": True,
    }


def _int(lo: int | None = None, hi: int | None = None) -> Schema:
    schema: Schema = {"type": "integer", "nullable": True}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return schema


def _nullable(schema: Schema) -> Schema:
    return {**schema, "nullable": True}


def _obj(props: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    schema: Schema = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(required)
    return schema


TOKEN_IDS: Schema = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
}

SAMPLING: dict[str, Schema] = {
    "model": _nullable(STR),
    "temperature": _num(0, 2),
    "top_p": _num(0, 1, lo_open=True),
    "top_k": _int(-1, 2**31 - 1),
    "min_p": _num(0, 1),
    "n": _int(1, MAX_N),
    "seed": _int(-(2**63), 2**63 - 1),
    "stop": {
        "anyOf": [STR, {"type": "array", "items": STR, "maxItems": MAX_STOP}],
        "nullable": True,
    },
    "stop_token_ids": _nullable(TOKEN_IDS),
    "presence_penalty": _num(-2, 2),
    "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(0, 100, lo_open=True),
    "logit_bias": {
        "type": "object",
        "nullable": True,
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id (as a string of digits) -> bias in [-100, 100]",
    },
    "ignore_eos": _nullable(BOOL),
    "min_tokens": _int(0, 2**31 - 1),
    "stream": _nullable(BOOL),
    "stream_options": _nullable(_obj({"include_usage": _nullable(BOOL)})),
    "skip_special_tokens": _nullable(BOOL),
    "include_stop_str_in_output": _nullable(BOOL),
    "priority": _int(-(2**31), 2**31 - 1),
    "user": _nullable(STR),
}

CONTENT_PART = {
    "anyOf": [
        _obj({"type": {"type": "string", "enum": ["text"]}, "text": STR}, ("type", "text")),
        _obj(
            {
                "type": {"type": "string", "enum": ["image_url"]},
                "image_url": _obj({"url": STR}, ("url",)),
            },
            ("type", "image_url"),
        ),
    ]
}
MESSAGE = _obj(
    {
        "role": {"type": "string", "enum": list(ROLES)},
        "content": {"anyOf": [STR, {"type": "array", "items": CONTENT_PART}], "nullable": True},
    },
    ("role",),
)
MESSAGES = {"type": "array", "items": MESSAGE, "minItems": 1}

CHAT_REQUEST = _obj(
    {
        "messages": MESSAGES,
        "max_tokens": _int(1),
        "max_completion_tokens": _int(1),
        "logprobs": _nullable(BOOL),
        "top_logprobs": _int(0, MAX_LOGPROBS),
        **SAMPLING,
    },
    ("messages",),
)
PROMPT = {
    "anyOf": [
        STR,
        {"type": "array", "items": STR, "minItems": 1, "maxItems": MAX_PROMPTS},
        {**TOKEN_IDS, "minItems": 1},
        {
            "type": "array",
            "items": {**TOKEN_IDS, "minItems": 1},
            "minItems": 1,
            "maxItems": MAX_PROMPTS,
        },
    ]
}
COMPLETION_REQUEST = _obj(
    {
        "prompt": PROMPT,
        "max_tokens": _int(1),
        "logprobs": _int(0, MAX_LOGPROBS),
        "echo": _nullable(BOOL),
        **SAMPLING,
    },
    ("prompt",),
)

USAGE = _obj(
    {
        "prompt_tokens": INT,
        "completion_tokens": INT,
        "total_tokens": INT,
        "prompt_tokens_details": _obj({"cached_tokens": INT}),
    },
    ("prompt_tokens", "completion_tokens", "total_tokens"),
)
FINISH: Schema = {"type": "string", "nullable": True}
LOGPROBS: Schema = {"type": "object", "nullable": True}
CHAT_CHOICE = _obj(
    {
        "index": INT,
        "message": _obj({"role": STR, "content": _nullable(STR)}, ("role",)),
        "logprobs": LOGPROBS,
        "finish_reason": FINISH,
    },
    ("index", "message", "finish_reason"),
)
COMPLETION_CHOICE = _obj(
    {"index": INT, "text": STR, "logprobs": LOGPROBS, "finish_reason": FINISH},
    ("index", "text", "finish_reason"),
)


def _completion(obj: str, choice: Schema) -> Schema:
    props = {
        "id": STR,
        "object": {"type": "string", "enum": [obj]},
        "created": INT,
        "model": STR,
        "choices": {"type": "array", "items": choice},
        "usage": USAGE,
    }
    return _obj(props, ("id", "object", "created", "model", "choices", "usage"))


# One server-sent event (OpenAPI < 3.2: `schema` describes each event): its data is a
# JSON chunk, a JSON error object, or the final "[DONE]".
SSE_EVENT = _obj({"data": STR, "event": STR, "id": STR}, ("data",))

ERROR = _obj(
    {
        "error": _obj(
            {"message": STR, "type": STR, "param": _nullable(STR), "code": _nullable(STR)},
            ("message", "type", "param", "code"),
        )
    },
    ("error",),
)

SCHEMAS: dict[str, Schema] = {
    "Error": ERROR,
    "ChatCompletionRequest": CHAT_REQUEST,
    "CompletionRequest": COMPLETION_REQUEST,
    "ChatCompletion": _completion("chat.completion", CHAT_CHOICE),
    "Completion": _completion("text_completion", COMPLETION_CHOICE),
    "TokenizeRequest": _obj(
        {
            "model": _nullable(STR),
            "prompt": _nullable(STR),
            "messages": _nullable(MESSAGES),
            "add_special_tokens": _nullable(BOOL),
        }
    ),
    "TokenizeResponse": _obj(
        {
            "count": INT,
            "max_model_len": INT,
            "tokens": {"type": "array", "items": INT},
            "token_strs": {"type": "array", "items": STR},
        },
        ("count", "max_model_len", "tokens"),
    ),
    "DetokenizeRequest": _obj({"model": _nullable(STR), "tokens": TOKEN_IDS}, ("tokens",)),
    "DetokenizeResponse": _obj({"prompt": STR}, ("prompt",)),
    "ModelList": _obj(
        {
            "object": STR,
            "data": {
                "type": "array",
                "items": _obj(
                    {"id": STR, "object": STR, "created": INT, "owned_by": STR}, ("id", "object")
                ),
            },
        },
        ("object", "data"),
    ),
}

_ERROR_CODES = {
    "400": "Malformed or invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Body too large",
    "429": "Too many requests in flight",
    "503": "The engine is unavailable or the server is draining",
}


def _json(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}


def _errors(*codes: str) -> dict[str, Schema]:
    return {c: {"description": _ERROR_CODES[c], "content": _json(_ref("Error"))} for c in codes}


def _post(summary: str, request: str, response: str, stream: bool) -> Schema:
    content = _json(_ref(response))
    if stream:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(_ref(request))},
            "responses": {
                "200": {
                    "description": "OK (an SSE stream when stream is true)",
                    "content": content,
                },
                **_errors("400", "401", "404", "413", "429", "503"),
            },
        }
    }


def _get(summary: str, content: Schema, *errors: str) -> Schema:
    responses = {"200": {"description": "OK", "content": content}, **_errors(*errors)}
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(version: str) -> Schema:
    """The OpenAPI 3.0 document of every route."""
    text = {"text/plain": {"schema": STR}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "Tessera gateway", "version": version},
        "paths": {
            "/v1/chat/completions": _post(
                "Chat completion", "ChatCompletionRequest", "ChatCompletion", True
            ),
            "/v1/completions": _post("Text completion", "CompletionRequest", "Completion", True),
            "/v1/models": _get("List models", _json(_ref("ModelList")), "401", "503"),
            "/health": _get("200 while the engine serves", _json(_obj({"status": STR})), "503"),
            "/metrics": _get("Prometheus metrics", text),
            "/tokenize": _post("Tokenize", "TokenizeRequest", "TokenizeResponse", False),
            "/detokenize": _post("Detokenize", "DetokenizeRequest", "DetokenizeResponse", False),
            "/version": _get("Server version", _json(_obj({"version": STR}, ("version",)))),
            "/openapi.json": _get("This document", _json({"type": "object"})),
        },
        "components": {"schemas": SCHEMAS},
    }
