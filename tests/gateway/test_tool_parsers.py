"""`--tool-call-parser`: recorded model texts of each format parse into content and tool calls
as vLLM's parsers read them, whole and streamed in any chunking, and the official openai
client reads the calls through the live gateway (the fake engine answers the text)."""

from __future__ import annotations

import json
import random
import types
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.protocol import Tool
from gateway.tokenizer import Tokenizer
from gateway.tool_parsers import detect
from gateway.tools import ToolPlan, ToolStream
from tests.gateway.conftest import Stack, start_stack

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"},
                "metric": {"type": "boolean"}, "hours": {"type": "array"},
            },
        },
    },
}  # fmt: skip
TOOLS = (Tool.model_validate(WEATHER),)
PARIS = ("get_weather", {"city": "Paris", "days": 3})
ROME = ("get_weather", {"city": "Rome"})

# (parser, model text, content, [(name, arguments)])
CASES: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}\n</tool_call>', "Sure.", [PARIS]),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
     None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}; {"name": "get_weather", "parameters": {"city": "Rome"}}', None, [PARIS, ROME]),
    ("llama3_json", "The weather is sunny.", "The weather is sunny.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # no name: content
    ("mistral", 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]', "Checking.",
     [PARIS, ROME]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Rome"}', None, [ROME]),  # tokenizer v11
    ("mistral", "Plain answer.", "Plain answer.", []),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "Let me check.\n", [PARIS]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
     "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
     "</function>\n</tool_call>", None,
     [("get_weather", {"city": "Rome", "metric": True, "hours": [1, 2]})]),
]  # fmt: skip


def _calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_outputs_parse_like_vllm(
    parser: str, text: str, content: str | None, calls: list[Any]
) -> None:
    got_content, got_calls = ToolPlan("auto", TOOLS, parser=parser).parse(text)
    assert got_content == content
    assert _calls(got_calls) == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_every_chunking_streams_the_same_calls(
    parser: str, text: str, content: str | None, calls: list[Any]
) -> None:
    rng = random.Random(1)
    plan = ToolPlan("auto", TOOLS, parser=parser)
    for trial in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(trial % 7, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ToolStream(plan)
        deltas = [d for p in pieces for d in stream.feed(p)]
        rest, called = stream.finish()
        deltas += rest
        said = "".join(d.get("content", "") for d in deltas)
        assert said == (content or ""), pieces
        assert called == bool(calls)
        heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        names = [h["function"]["name"] for h in heads if "id" in h]
        args = [
            "".join(h["function"]["arguments"] for h in heads if h["index"] == k)
            for k in range(len(names))
        ]
        assert list(zip(names, map(json.loads, args), strict=True)) == calls


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    _, [call] = ToolPlan("auto", TOOLS, parser="mistral").parse(CASES[7][1])
    assert len(call.id) == 9 and call.id.isalnum()


def _tokenizer(vocab: dict[str, int], template: str = "") -> Any:
    return types.SimpleNamespace(get_vocab=lambda: vocab, chat_template=template)


def test_auto_picks_the_format_of_the_model_family(tokenizer: Tokenizer) -> None:
    assert detect(tokenizer.hf) == "hermes"  # SmolLM2 writes Hermes blocks
    assert detect(_tokenizer({"<|python_tag|>": 1})) == "llama3_json"
    assert detect(_tokenizer({"[TOOL_CALLS]": 5})) == "mistral"
    coder = "{% if tools %}<function={{ name }}><parameter={{ key }}>{% endif %}"
    assert detect(_tokenizer({"<tool_call>": 7}, coder)) == "qwen3_coder"


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer) -> Iterator[Stack]:
    s = start_stack(tokenizer, tool_call_parser="llama3_json")
    yield s
    s.stop()


def test_the_openai_client_reads_llama3_json_calls(stack: Stack, tokenizer: Tokenizer) -> None:
    stack.engine.answer_ids = tokenizer.encode(CASES[3][1], add_special_tokens=False)
    client: Any = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    ask: Any = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    reply = client.chat.completions.create(model="fake-smollm", messages=ask, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [PARIS, ROME]
    stream = client.chat.completions.create(
        model="fake-smollm", messages=ask, tools=[WEATHER], stream=True
    )
    names = [
        call.function.name
        for chunk in stream
        for c in chunk.choices
        for call in c.delta.tool_calls or []
        if call.function and call.function.name
    ]
    assert names == ["get_weather", "get_weather"]
