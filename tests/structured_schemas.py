"""Twenty JSON schemas for structured-output tests (shared by the worker, offline and gateway suites).

They cover nested objects, arrays (with item and length bounds), enums, integers and
numbers with bounds, required and optional fields, and strings with patterns or lengths.
Each entry is (name, schema, prompt): the prompt nudges the model toward the schema's
content, but validity must come from the constraint, not from the prompt.

Numbers bound their decimals with `multipleOf`: the grammar puts no limit on the digits of
a bare `number`, and at temperature 1 the 135M model sometimes writes digits until
max_tokens (truncation, finish_reason "length", as with vLLM's grammar backends), which is
not a constraint violation but would make these tests flaky. The steps are binary fractions
(0.5, 0.25, 0.125): jsonschema checks multipleOf in float arithmetic, where 18.2 is "not a
multiple of 0.1".
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_PERSON: Schema = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

SCHEMAS: list[tuple[str, Schema, str]] = [
    ("person", _PERSON, "Describe a person as JSON with name and age."),
    (
        "integer_bounds",
        {
            "type": "object",
            "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["score"],
            "additionalProperties": False,
        },
        "Give a test score from 0 to 100 as JSON.",
    ),
    (
        "number_bounds",
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.5},
                "humidity": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125},
            },
            "required": ["temperature", "humidity"],
            "additionalProperties": False,
        },
        "Report today's weather as JSON.",
    ),
    (
        "enum_color",
        {
            "type": "object",
            "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
        "Pick a color as JSON.",
    ),
    (
        "nested_address",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 20},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "Give a name and postal address as JSON.",
    ),
    (
        "string_array",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "minItems": 1,
                    "maxItems": 4,
                }
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
        "List a few tags for a blog post about cooking, as JSON.",
    ),
    (
        "integer_array",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 9},
            "minItems": 2,
            "maxItems": 5,
        },
        "Give a short list of small integers as a JSON array.",
    ),
    (
        "optional_fields",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 30},
                "subtitle": {"type": "string", "maxLength": 30},
                "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
        "Describe a book as JSON.",
    ),
    (
        "pattern_date",
        {
            "type": "object",
            "properties": {
                "event": {"type": "string", "maxLength": 20},
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            },
            "required": ["event", "date"],
            "additionalProperties": False,
        },
        "Name an event and its date (YYYY-MM-DD) as JSON.",
    ),
    (
        "boolean_flags",
        {
            "type": "object",
            "properties": {"active": {"type": "boolean"}, "admin": {"type": "boolean"}},
            "required": ["active", "admin"],
            "additionalProperties": False,
        },
        "Describe a user's flags as JSON.",
    ),
    (
        "array_of_objects",
        {
            "type": "object",
            "properties": {"people": {"type": "array", "items": _PERSON, "maxItems": 3}},
            "required": ["people"],
            "additionalProperties": False,
        },
        "List some people with names and ages as JSON.",
    ),
    (
        "enum_integer",
        {
            "type": "object",
            "properties": {
                "priority": {"enum": [1, 2, 3]},
                "status": {"type": "string", "enum": ["open", "closed", "pending"]},
            },
            "required": ["priority", "status"],
            "additionalProperties": False,
        },
        "Describe a ticket's priority and status as JSON.",
    ),
    (
        "deep_nesting",
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {
                        "b": {
                            "type": "object",
                            "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["c"],
                            "additionalProperties": False,
                        }
                    },
                    "required": ["b"],
                    "additionalProperties": False,
                }
            },
            "required": ["a"],
            "additionalProperties": False,
        },
        "Output a nested JSON object.",
    ),
    (
        "string_lengths",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
            "required": ["code"],
            "additionalProperties": False,
        },
        "Give a short product code as JSON.",
    ),
    (
        "pattern_identifier",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                "email_domain": {"type": "string", "enum": ["example.com", "example.org"]},
            },
            "required": ["username", "email_domain"],
            "additionalProperties": False,
        },
        "Create a user account as JSON.",
    ),
    (
        "nullable_field",
        {
            "type": "object",
            "properties": {
                "nickname": {"type": ["string", "null"], "maxLength": 15},
                "level": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["nickname", "level"],
            "additionalProperties": False,
        },
        "Describe a game character as JSON.",
    ),
    (
        "any_of",
        {
            "type": "object",
            "properties": {
                "value": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 1000},
                        {"type": "string", "maxLength": 10},
                    ]
                }
            },
            "required": ["value"],
            "additionalProperties": False,
        },
        "Give a value that is a number or a word, as JSON.",
    ),
    (
        "product",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1},
                "name": {"type": "string", "maxLength": 25},
                "price": {"type": "number", "minimum": 0, "maximum": 10000, "multipleOf": 0.25},
                "in_stock": {"type": "boolean"},
                "category": {"type": "string", "enum": ["book", "toy", "food"]},
            },
            "required": ["id", "name", "price", "in_stock", "category"],
            "additionalProperties": False,
        },
        "Describe a product in a shop as JSON.",
    ),
    (
        "matrix",
        {
            "type": "object",
            "properties": {
                "rows": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": -9, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["rows"],
            "additionalProperties": False,
        },
        "Give a 2x2 integer matrix as JSON.",
    ),
    (
        "const_and_ref",
        {
            "type": "object",
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 99},
                        "y": {"type": "integer", "minimum": 0, "maximum": 99},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "properties": {
                "kind": {"const": "segment"},
                "start": {"$ref": "#/$defs/point"},
                "end": {"$ref": "#/$defs/point"},
            },
            "required": ["kind", "start", "end"],
            "additionalProperties": False,
        },
        "Describe a line segment with two points as JSON.",
    ),
]

assert len(SCHEMAS) == 20
