"""services.structured_output.check: bad constraints are ValueErrors with clear messages, cheaply."""

from __future__ import annotations

import json
import time

import pytest

from services import structured_output
from services.types import StructuredOutputParams
from tests.structured_schemas import SCHEMAS


@pytest.mark.parametrize(
    "name,schema", [(n, s) for n, s, _ in SCHEMAS], ids=[n for n, *_ in SCHEMAS]
)
def test_fixture_schemas_compile(name: str, schema: dict) -> None:
    structured_output.check(StructuredOutputParams(json=json.dumps(schema)))


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputParams(json_object=True),
        StructuredOutputParams(regex=r"\d{3}-\d{4}"),
        StructuredOutputParams(choice=("positive", "negative", "neutral")),
        StructuredOutputParams(grammar='start: "yes" | "no"'),  # Lark
        StructuredOutputParams(grammar='root ::= "yes" | "no"'),  # GBNF
    ],
    ids=["json_object", "regex", "choice", "lark", "gbnf"],
)
def test_valid_constraints_pass(constraint: StructuredOutputParams) -> None:
    structured_output.check(constraint)
    assert structured_output.grammar_text(constraint)


@pytest.mark.parametrize(
    "constraint,message",
    [
        (
            StructuredOutputParams(json='{"type": '),
            "invalid JSON schema constraint: Expecting value",
        ),
        (StructuredOutputParams(json='{"type": "foo"}'), "invalid JSON schema constraint: .*foo"),
        (
            StructuredOutputParams(json='{"type": "integer", "minimum": 5, "maximum": 1}'),
            "invalid JSON schema constraint: Unsatisfiable",
        ),
        (StructuredOutputParams(json='{"$ref": "#/nope"}'), "invalid JSON schema constraint"),
        (StructuredOutputParams(regex="(["), "(?s)invalid regex constraint: .*unclosed"),
        (StructuredOutputParams(choice=()), "invalid choice constraint: .*at least one"),
        (StructuredOutputParams(grammar="start: undefined_rule"), "invalid grammar constraint"),
    ],
    ids=["json_syntax", "json_type", "json_bounds", "json_ref", "regex", "empty_choice", "grammar"],
)
def test_invalid_constraints_raise_value_error(
    constraint: StructuredOutputParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        structured_output.check(constraint)
    with pytest.raises(ValueError, match=message):
        structured_output.grammar_text(constraint)


def test_check_is_cached_by_constraint() -> None:
    schema = json.dumps({"type": "object", "properties": {"k": {"type": "string"}}, "x": 1})
    hits = structured_output._error.cache_info().hits
    structured_output.check(StructuredOutputParams(json=schema))
    t0 = time.perf_counter()
    for _ in range(100):
        structured_output.check(StructuredOutputParams(json=schema))  # an equal, new object
    assert structured_output._error.cache_info().hits == hits + 100
    assert (time.perf_counter() - t0) / 100 < 1e-3


def test_module_imports_no_torch() -> None:
    """The gateway calls check(); it must stay cheap to import (no torch)."""
    import subprocess
    import sys

    code = "import sys, services.structured_output; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
