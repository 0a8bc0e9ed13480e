"""Structured-output request fields -> one checked `StructuredOutputParams`.

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs`
and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` all
map to the same constraint. At most one may be given; it is compiled once by
`services.structured_output.check` (cached), so a bad schema, regex or grammar is a 400
before anything is queued.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import Field, model_validator

from gateway.errors import InvalidRequest
from gateway.strict import Strict
from services import structured_output
from services.types import StructuredOutputParams

log = logging.getLogger(__name__)
JsonSchema = dict[str, Any]


class JsonSchemaFormat(Strict):
    """response_format.json_schema: a named JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(Strict):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when 'type' is 'json_schema'")
        return self

    def params(self) -> StructuredOutputParams | None:
        if self.type == "json_object":
            return StructuredOutputParams(json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.schema_
            if schema is None:
                return StructuredOutputParams(json_object=True)
            return StructuredOutputParams(json=json.dumps(schema))
        return None


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: str | JsonSchema | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [self.json_, self.regex, self.choice, self.grammar, self.json_object or None]
        if sum(v is not None for v in given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self

    def params(self) -> StructuredOutputParams | None:
        return _params(self.json_, self.regex, self.choice, self.grammar, bool(self.json_object))


class GuidedFields(Strict):
    """The structured-output fields of chat and completions requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | JsonSchema | None = None  # vLLM's older names for the same constraints
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    def constraint(self) -> StructuredOutputParams | None:
        """The one checked constraint of the request, or None; 400 when it is invalid."""
        found = self._given()
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise InvalidRequest(f"give at most one output constraint, got {names}", found[1][0])
        return checked(*found[0]) if found else None

    def _given(self) -> list[tuple[str, StructuredOutputParams]]:
        rf, so = self.response_format, self.structured_outputs
        found = [
            ("response_format", rf.params() if rf else None),
            ("structured_outputs", so.params() if so else None),
            ("guided_json", _params(schema=self.guided_json)),
            ("guided_regex", _params(regex=self.guided_regex)),
            ("guided_choice", _params(choice=self.guided_choice)),
            ("guided_grammar", _params(grammar=self.guided_grammar)),
        ]
        return [(name, p) for name, p in found if p is not None]


def _params(
    schema: str | JsonSchema | None = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    json_object: bool = False,
) -> StructuredOutputParams | None:
    """The constraint of the one given argument; None when none is."""
    if schema is None and regex is None and choice is None and grammar is None:
        return StructuredOutputParams(json_object=True) if json_object else None
    text = schema if isinstance(schema, str) or schema is None else json.dumps(schema)
    return StructuredOutputParams(
        json=text,
        regex=regex,
        choice=tuple(choice) if choice is not None else None,
        grammar=grammar,
    )


def checked(param: str, params: StructuredOutputParams) -> StructuredOutputParams:
    """`params` once it compiles; a 400 naming `param` when it does not."""
    try:
        structured_output.check(params)
    except ValueError as exc:
        raise InvalidRequest(f"'{param}' is not a valid constraint: {exc}", param) from None
    except Exception as exc:  # a compiler error on user input is still the user's input
        log.warning("constraint of %s failed to compile: %r", param, exc)
        raise InvalidRequest(f"'{param}' is not a valid constraint: {exc}", param) from None
    return params
