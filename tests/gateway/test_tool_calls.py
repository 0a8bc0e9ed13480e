"""Tool calls through the live gateway and the fake EngineCore, with the official openai client.

The fake engine answers with the tokens of a chosen text, so these tests pin the
gateway's half: the prompt that offers the tools, the constraint sent to the engine,
parsing, finish_reason and the streamed tool_calls deltas (the real model's half is in
test_structured_model.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest

from gateway import schemas
from gateway.reasoning import partial_tag
from gateway.tokenizer import Tokenizer
from gateway.tools import ToolPlan, ToolStream
from tests.gateway.conftest import API_KEY, Stack
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine

pytestmark = pytest.mark.slow
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture
def client(stack: Stack) -> Any:  # Any: the typed unions of the SDK add nothing here
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def answer(engine: FakeEngine, tokenizer: Tokenizer) -> Iterator[Any]:
    """Set what the fake engine answers (restored afterwards)."""
    saved = engine.answer_ids

    def set_answer(text: str) -> None:
        engine.answer_ids = tokenizer.encode(text, add_special_tokens=False)

    yield set_answer
    engine.answer_ids = saved


def collect_stream(stream: Any) -> tuple[str, list[dict[str, Any]], str | None, list[Any]]:
    """(content, tool calls, finish_reason, raw tool_calls deltas) of a streamed choice."""
    content, finish = "", None
    calls: list[dict[str, Any]] = []
    deltas: list[Any] = []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                deltas.append(d)
                if d.index == len(calls):
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish, deltas


def test_auto_parses_hermes_calls_streaming_and_not(
    client: Any, engine: FakeEngine, answer: Any, tokenizer: Tokenizer
) -> None:
    answer(HERMES)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME])
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {}]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    request = engine.requests[-1]
    assert request.sampling_params.structured_output is None  # auto: nothing forced
    prompt = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"name":"get_weather"' in prompt and "<tool_call>" in prompt

    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], stream=True
    )
    content, streamed, finish, deltas = collect_stream(stream)
    assert finish == "tool_calls" and content == "Let me look."
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    first = deltas[0]  # OpenAI's shape: index, id, type, name and "" arguments first
    assert (first.index, first.type, first.function.arguments) == (0, "function", "")
    assert first.id.startswith("call_")


def test_auto_without_a_call_is_plain_content(client: Any, answer: Any) -> None:
    answer("No tool needed: it is < 20 degrees.")
    reply = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER])
    assert reply.choices[0].message.content == "No tool needed: it is < 20 degrees."
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], stream=True
    )
    content, calls, finish, _ = collect_stream(stream)
    assert (content, calls, finish) == ("No tool needed: it is < 20 degrees.", [], "stop")


def test_required_constrains_to_an_array_of_calls(
    client: Any, engine: FakeEngine, answer: Any
) -> None:
    answer('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]')
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required"
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo", "days": 2},
    )
    assert reply.choices[0].message.content is None
    assert reply.choices[0].finish_reason == "tool_calls"
    constraint = engine.requests[-1].sampling_params.structured_output
    assert constraint is not None and constraint.json is not None
    schema = json.loads(constraint.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["get_weather"], ["get_time"]]
    assert branches[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert all(b["additionalProperties"] is False for b in branches)
    client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    single = engine.requests[-1].sampling_params.structured_output
    assert single is not None and json.loads(single.json or "")["maxItems"] == 1


def test_named_function_streams_its_arguments(client: Any, engine: FakeEngine, answer: Any) -> None:
    answer('{"city": "Rome", "days": 3}')
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == (
        "get_weather",
        '{"city": "Rome", "days": 3}',
    )
    constraint = engine.requests[-1].sampling_params.structured_output
    assert constraint is not None
    assert json.loads(constraint.json or "") == WEATHER["function"]["parameters"]
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, stream=True
    )
    content, calls, finish, deltas = collect_stream(stream)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert len(deltas) > 3  # the arguments arrived as fragments, token by token


def test_tool_choice_none_offers_no_tools(
    client: Any, engine: FakeEngine, answer: Any, tokenizer: Tokenizer
) -> None:
    answer(HERMES)
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="none"
    )
    assert reply.choices[0].message.content == HERMES and not reply.choices[0].message.tool_calls
    assert tokenizer.encode_chat(ASK) == engine.requests[-1].prompt_token_ids


def test_tool_turns_are_rendered_in_the_next_request(
    client: Any, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    messages: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]
    client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER])
    prompt = tokenizer.decode(engine.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call><|im_end|>" in prompt
    )
    assert "<|im_start|>tool\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_tool_stream_concatenates_to_the_parse(mode: Literal["auto", "required"]) -> None:
    text = (
        HERMES
        if mode == "auto"
        else '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    plan = ToolPlan(mode, (), None)
    content, calls = plan.parse(text)
    for step in (1, 3, 7):  # any split of the text into deltas gives the same result
        stream = ToolStream(plan)
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
        rest, called = stream.finish()
        deltas += rest
        assert called
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        names = [d["tool_calls"][0]["function"].get("name") for d in deltas if "tool_calls" in d]
        assert [n for n in names if n] == [c.name for c in calls]
        args = "".join(
            d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d
        )
        assert args == "".join(c.arguments for c in calls)


def test_partial_tag_holds_back_only_a_possible_tag_start() -> None:
    assert partial_tag("hello <tool", "<tool_call>") == 5
    assert partial_tag("hello <", "<tool_call>") == 1
    assert partial_tag("hello", "<tool_call>") == 0
    assert partial_tag("a < b", "<tool_call>") == 0


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tool_answers_match_the_declared_response_models(
    stack: Stack, answer: Any, choice: str
) -> None:
    answer(HERMES if choice == "auto" else '[{"name": "get_time", "parameters": {}}]')
    body = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice}
    url, auth = f"{stack.base_url}/v1/chat/completions", {"Authorization": f"Bearer {API_KEY}"}
    reply = schemas.ChatCompletion.model_validate(httpx.post(url, json=body, headers=auth).json())
    assert reply.choices[0].message.tool_calls
    events = httpx.post(url, json={**body, "stream": True}, headers=auth).text.splitlines()
    data = [line[6:] for line in events if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [schemas.ChatCompletionChunk.model_validate_json(d) for d in data[:-1]]
    assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)


def test_every_choice_of_n_streams_its_own_calls(client: Any, answer: Any) -> None:
    answer(HERMES)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], n=2, stream=True
    )
    calls: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            calls[choice.index] += [d.function.name for d in choice.delta.tool_calls or [] if d.id]
            finish[choice.index] = choice.finish_reason or finish.get(choice.index, "")
    assert calls == {0: ["get_weather", "get_time"], 1: ["get_weather", "get_time"]}
    assert finish == {0: "tool_calls", 1: "tool_calls"}
