"""Structured output and tool calls end to end: `tessera serve` with the real default model,
driven over HTTP by the official openai client (issue 15, acceptance 1 and 2).

Validity must come from the constraint: the prompts only hint at the content, and outputs
are sampled at temperature 1.0 with several seeds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from benchmarks.stack import Stack, start_stack
from tests.structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow
SEEDS = (0, 1, 2)
MAX_TOKENS = 400
WEATHER_PARAMS: Any = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS: Any = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather.", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Local time.", "parameters": TIME_PARAMS},
    },
]  # fmt: skip
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)  # bounded: unbounded digits can run on


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = start_stack()
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


@pytest.fixture(scope="module")
def client(stack: Stack) -> Any:  # Any: the SDK's typed unions add nothing to these checks
    return openai.OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=900
    )


def chat_text(client: Any, stream: bool, **kwargs: Any) -> tuple[str, str | None]:
    """(content, finish_reason) of one chat completion, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(model="", **kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model="", stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def tool_calls(
    client: Any, stream: bool, **kwargs: Any
) -> tuple[list[tuple[str, str]], str | None]:
    """([(name, arguments)], finish_reason) of one chat completion with tools."""
    if not stream:
        choice = client.chat.completions.create(model="", **kwargs).choices[0]
        calls = choice.message.tool_calls or []
        return [(c.function.name, c.function.arguments) for c in calls], choice.finish_reason
    found: list[list[str]] = []
    finish = None
    for chunk in client.chat.completions.create(model="", stream=True, **kwargs):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.index == len(found):
                    assert d.id and d.type == "function" and d.function.arguments == ""
                    found.append([d.function.name, ""])
                found[d.index][1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(name, args) for name, args in found], finish


def test_parse_returns_a_parsed_pydantic_object(client: Any) -> None:
    messages: Any = [{"role": "user", "content": "Tell me about Paris as JSON."}]
    completion = client.chat.completions.parse(
        model="", messages=messages, response_format=City, temperature=0, max_tokens=MAX_TOKENS
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City), completion.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_required_tool_calls_validate_against_their_schema(client: Any, stream: bool) -> None:
    for seed in SEEDS:
        calls, finish = tool_calls(
            client, stream, messages=ASK, tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
        )  # fmt: skip
        assert calls and finish == "tool_calls"
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMS[name])


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_streamed_tool_calls_equal_the_non_streamed_ones(client: Any, choice: Any) -> None:
    kwargs = dict(
        messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=MAX_TOKENS
    )
    plain, plain_finish = tool_calls(client, False, **kwargs)
    streamed, stream_finish = tool_calls(client, True, **kwargs)
    assert plain and streamed == plain and stream_finish == plain_finish == "tool_calls"
    if isinstance(choice, dict):
        ((name, arguments),) = plain
        assert name == "get_time"
        jsonschema.validate(json.loads(arguments), TIME_PARAMS)


def test_twenty_schemas_three_seeds_streaming_and_not(client: Any) -> None:
    cases = [(s, seed, stream) for s in SCHEMAS for seed in SEEDS for stream in (False, True)]

    def run(case: tuple[tuple[str, Any, str], int, bool]) -> tuple[str, str | None]:
        (name, schema, prompt), seed, stream = case
        response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        return chat_text(
            client, stream, messages=[{"role": "user", "content": prompt}],
            response_format=response_format, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
        )  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, cases))
    failed = []
    for ((name, schema, _), seed, stream), (text, finish) in zip(cases, results, strict=True):
        try:
            assert finish == "stop", f"finish_reason {finish}"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failed.append(f"{name} seed={seed} stream={stream}: {str(exc)[:80]} {text!r:.120}")
    assert not failed, f"{len(failed)} of {len(cases)} failed:\n" + "\n".join(failed)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_regex_and_choice_constraints(client: Any, stream: bool) -> None:
    phone = r"\+33 [1-9]( [0-9]{2}){4}"
    colors = ["red", "green", "blue"]
    for seed in SEEDS:
        common = dict(temperature=1.0, seed=seed, max_tokens=60)
        text, _ = chat_text(
            client, stream, messages=[{"role": "user", "content": "A French phone number?"}],
            extra_body={"structured_outputs": {"regex": phone}}, **common,
        )  # fmt: skip
        assert re.fullmatch(phone, text), text
        text, _ = chat_text(
            client, stream, messages=[{"role": "user", "content": "Name a colour."}],
            extra_body={"guided_choice": colors}, **common,
        )  # fmt: skip
        assert text in colors


def test_completions_take_a_json_schema_too(client: Any) -> None:
    schema = SCHEMAS[0][1]
    reply = client.completions.create(
        model="", prompt="A person as JSON: ", max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=2,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
    )  # fmt: skip
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.text), schema)
