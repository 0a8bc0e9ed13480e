"""Property-based checks of the live gateway against its own /openapi.json (schemathesis)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from gateway.app import version
from gateway.openapi import openapi_document
from tests.gateway.conftest import API_KEY, Stack

pytestmark = pytest.mark.slow
schema = schemathesis.openapi.from_dict(openapi_document(version()))
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_served_document_is_the_checked_one(stack: Stack) -> None:
    assert httpx.get(f"{stack.base_url}/openapi.json").json() == openapi_document(version())


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms_to_its_schema(case: schemathesis.Case, stack: Stack) -> None:
    # A schema-valid body may still be refused with 400 for cross-field reasons the schema
    # cannot state (prompt + max_tokens beyond the context, min_tokens > max_tokens, token ids
    # outside the vocabulary), so "valid data is accepted" is not checked; every other check is.
    case.call_and_validate(
        base_url=stack.base_url,
        headers=AUTH,
        timeout=30,
        excluded_checks=[schemathesis.checks.positive_data_acceptance],
    )
