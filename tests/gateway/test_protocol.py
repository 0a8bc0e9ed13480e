"""The request models without a server: error paths and messages, defaults, constraints, tools.

Fast (no model, no sockets), so `make test-fast` covers the protocol too; the live-server
suites (test_bad_inputs.py, test_structured_inputs.py, test_tool_calls.py) cover the wiring.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway import tools
from gateway.chat_format import shaped
from gateway.errors import InvalidRequest
from gateway.protocol import ChatCompletionRequest, CompletionRequest, parse
from services.types import StructuredOutputParams

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"messages": USER, **fields})


def error(model: Any, body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        result = parse(model, body)
        if isinstance(result, ChatCompletionRequest):
            tools.chat_options(result)
        elif isinstance(result, CompletionRequest):
            result.options()
    return caught.value


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": USER, "temperature": "hot"}, "temperature", "must be a number, not a string"),
        ({"messages": USER, "max_tokens": True}, "max_tokens", "must be an integer, not a boolean"),
        ({"messages": USER, "n": 0}, "n", "greater than or equal to 1"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]", "'text' is required"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be"),
        ({"messages": USER, "stop": ["a", 2]}, "stop[1]", "must be a string"),
        ({"messages": USER, "logit_bias": {"7": 500}}, "logit_bias", "less than or equal to 100"),
        ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
        ({"messages": USER, "frobnicate": 1}, "frobnicate", "'frobnicate' is not supported"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs", "requires 'logprobs'"),
        ({"messages": []}, "messages", "'messages' must be a non-empty array"),
        ({}, "messages", "'messages' is required"),
        ({"messages": None}, "messages", "'messages' is required"),
    ],
)  # fmt: skip
def test_chat_errors_name_the_field(body: dict[str, Any], param: str, message: str) -> None:
    exc = error(ChatCompletionRequest, body)
    assert exc.param == param
    assert message in exc.message


def test_completion_prompt_errors() -> None:
    assert error(CompletionRequest, {"prompt": []}).param == "prompt"
    assert error(CompletionRequest, {"prompt": [[1], []]}).param == "prompt[1]"
    assert "at most 64" in error(CompletionRequest, {"prompt": ["a"] * 65}).message
    assert error(CompletionRequest, {"prompt": [1, -1]}).param == "prompt[1]"


def test_nulls_are_absent_and_defaults_apply() -> None:
    options = chat(temperature=None, stop=None, n=None, tools=None, logprobs=None).options()
    assert (options.temperature, options.stop, options.n, options.logprobs) == (1.0, (), 1, None)
    assert parse(CompletionRequest, {"prompt": "x"}).options().max_tokens == 16
    both = chat(max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=2).options()
    assert (both.max_tokens, both.logprobs) == (7, 2)
    assert chat(stop="end").options().stop == ("end",)


def test_grpc_options_share_the_checks() -> None:
    assert parse(CompletionRequest, {"prompt": "x", "top_k": 5}).options().top_k == 5
    assert error(CompletionRequest, {"prompt": "x", "top_p": 0}).param == "top_p"


def test_constraints_map_to_one_structured_output_params() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_format = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert as_format.options().structured_output == StructuredOutputParams(json=json.dumps(schema))
    choice = chat(structured_outputs={"choice": ["a", "b"]}).options().structured_output
    assert choice == StructuredOutputParams(choice=("a", "b"))
    assert chat(response_format={"type": "text"}).options().structured_output is None
    bad = error(ChatCompletionRequest, {"messages": USER, "guided_regex": "("})
    assert bad.param == "guided_regex" and "not a valid constraint" in bad.message


def test_required_and_named_tool_constraints() -> None:
    params = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    tool = {"type": "function", "function": {"name": "search", "parameters": params}}
    named = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "search"}})
    forced = tools.chat_options(named).structured_output
    assert forced is not None and json.loads(forced.json or "") == params
    required = tools.chat_options(chat(tools=[tool], tool_choice="required")).structured_output
    assert required is not None and json.loads(required.json or "")["type"] == "array"
    assert tools.chat_options(chat(tools=[tool])).structured_output is None  # auto
    assert tools.plan_for(chat(tools=[tool], tool_choice="none")) is None


def test_hermes_parse_keeps_text_before_the_calls_and_skips_broken_ones() -> None:
    plan = tools.ToolPlan("auto", ())
    text = 'Sure.<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{oops</tool_call>'
    content, calls = plan.parse(text)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}')]
    unterminated = '<tool_call>\n{"name": "b", "arguments": {}}'  # EOS before the closing tag
    assert [c.name for c in plan.parse(unterminated)[1]] == ["b"]
    assert plan.parse("plain text") == ("plain text", [])
    single = tools.ToolPlan("auto", (), parallel=False)  # parallel_tool_calls=false
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in single.parse(two)[1]] == ["a"]
    assert [c.name for c in plan.parse(two)[1]] == ["a", "b"]


def test_chat_turns_render_tools_hermes_style() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        tools=[{"type": "function", "function": {"name": "f"}}],
    )  # fmt: skip
    turns = tools.chat_turns(req.messages, req.tools, native=False)
    assert turns[0]["role"] == "system" and turns[0]["content"].startswith("Be brief.\n\n")
    assert '<tools>\n{"type":"function","function":{"name":"f"' in turns[0]["content"]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert turns[1] == {"role": "user", "content": parts}  # the template's format shapes it
    assert shaped(turns, "string")[1] == {"role": "user", "content": "ab"}
    assert tools.chat_turns(req.messages, None, native=False)[0] == {
        "role": "system",
        "content": "Be brief.",
    }
