"""Tool calls: the prompt that offers tools, the constraint that forces them, the call parser.

How a chat request uses its tools is a `ToolPlan`:
- "auto": tools are offered in the prompt; `<tool_call>{"name", "arguments"}</tool_call>`
  blocks in the output (the Hermes format, which SmolLM2 also follows) become calls;
- "required": the output is constrained to a JSON array of `{"name", "parameters"}`
  objects, one branch per tool (as vLLM does), each item a call;
- a named function: the output is constrained to that function's parameters schema and
  is the call's arguments.
Templates that ignore `tools` (the default model's ChatML template) get the tools in a
Hermes-style system message, tool calls of earlier turns as `<tool_call>` blocks and
tool results as `<tool_response>` blocks.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, replace
from typing import Any, Literal

from gateway.constraints import checked
from gateway.errors import InvalidRequest
from gateway.options import TextOptions
from gateway.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from gateway.tool_parsers import FORMATS, ToolFormat, json_text
from services.types import StructuredOutputParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}
HERMES_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>\n{tools}\n</tools>\nFor each function call return a json object "
    "with the function name and arguments within <tool_call></tool_call> XML tags as follows:"
    '\n<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def body(self) -> dict[str, Any]:
        """The call as OpenAI's message.tool_calls item."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools."""

    mode: Literal["auto", "required", "named"]
    tools: tuple[Tool, ...]
    function: str | None = None  # the named function
    parallel: bool = True
    parser: str = "hermes"  # the tool-call format of "auto" (gateway.tool_parsers)

    @property
    def format(self) -> ToolFormat:
        return FORMATS[self.parser]

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content is None when only calls were made."""
        if self.mode == "named":
            assert self.function is not None
            return None, [_call(self.function, text)]
        if self.mode == "required":
            content, found = None, _required_calls(text)
        else:
            content, found = self.format.parse(text, self.tools)
        calls = [ToolCall(name, args, self.format.call_id()) for name, args in found]
        calls = calls if self.parallel else calls[:1]  # parallel_tool_calls=false: one call
        return (content, calls) if calls else (text, [])


def plan_for(req: ChatCompletionRequest, parser: str = "hermes") -> ToolPlan | None:
    """The request's tool plan; None when no tool can be called."""
    choice = req.effective_tool_choice
    if choice == "none" or not req.tools:
        return None
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", tuple(req.tools), choice.function.name, parallel, parser)
    mode: Literal["required", "auto"] = "required" if choice == "required" else "auto"
    return ToolPlan(mode, tuple(req.tools), None, parallel, parser)


def chat_options(req: ChatCompletionRequest) -> TextOptions:
    """The request's options, with the constraint that forces its tool calls if any."""
    options = req.options()
    forced = tool_constraint(req)
    if forced is None:
        return options
    if options.structured_output is not None:
        raise InvalidRequest(
            "'tool_choice' forces a tool call; it cannot be combined with another output "
            "constraint (response_format, structured_outputs, guided_*)",
            "tool_choice",
        )
    return replace(options, structured_output=forced)


def tool_constraint(req: ChatCompletionRequest) -> StructuredOutputParams | None:
    """Every tool schema checked (400 when one does not compile); the forcing constraint."""
    for i, tool in enumerate(req.tools or []):
        text = json.dumps(tool.function.parameters or ANY_OBJECT)
        checked(f"tools[{i}].function.parameters", StructuredOutputParams(json=text))
    plan = plan_for(req)
    if plan is None or plan.mode == "auto":
        return None
    if plan.mode == "named":
        named = next(t for t in plan.tools if t.function.name == plan.function)
        schema = named.function.parameters or ANY_OBJECT
    else:
        schema = _calls_schema(plan)
    return checked("tool_choice", StructuredOutputParams(json=json.dumps(schema)))


def _calls_schema(plan: ToolPlan) -> dict[str, Any]:
    """A JSON array of {"name", "parameters"} objects, one anyOf branch per tool."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,  # else the model may add keys that never end
        }
        for t in plan.tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not plan.parallel:
        schema["maxItems"] = 1
    return schema


# -- parsing ----------------------------------------------------------------------------


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, f"call_{secrets.token_hex(12)}")


def _required_calls(text: str) -> list[tuple[str, str]]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [
        (item["name"], json_text(item.get("parameters", {})))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]


# -- streaming --------------------------------------------------------------------------


class ToolStream:
    """One choice's streamed text -> `content` and `tool_calls` deltas as OpenAI sends them.

    A call's first delta holds index, id, type, function.name and arguments ""; later ones
    argument fragments. Named functions stream their arguments as they are sampled; other
    modes send text until a call may start and the calls once the output is complete, so
    the concatenated stream equals `ToolPlan.parse` of the whole text.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.named = _call(plan.function or "", "")
        self.started = False  # the named call's first delta was sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for newly generated text."""
        self.text += text
        if self.plan.mode == "named":
            head = [] if self.started else [_head(0, self.named)]
            self.started = True
            return head + ([_fragment(0, text)] if text else [])
        if self.plan.mode == "required":
            return []
        cut = self.plan.format.call_start(self.text)
        safe = cut if cut >= 0 else len(self.text) - self.plan.format.held(self.text)
        return self._content(max(safe, self.sent))

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The deltas left once the output is complete, and whether any call was made."""
        if self.plan.mode == "named":
            return ([] if self.started else [_head(0, self.named)]), True
        auto = self.plan.mode == "auto"
        _, calls = self.plan.parse(self.text)
        if not calls or (auto and self.plan.format.call_start(self.text) < 0):
            return self._content(len(self.text)), False
        deltas = []
        for k, call in enumerate(calls):
            deltas += [_head(k, call), _fragment(k, call.arguments)]
        return deltas, True

    def _content(self, end: int) -> list[dict[str, Any]]:
        piece, self.sent = self.text[self.sent : end], end
        return [{"content": piece}] if piece else []


def _head(index: int, call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": ""}
    return {
        "tool_calls": [{"index": index, "id": call.id, "type": "function", "function": function}]
    }


def _fragment(index: int, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


# -- prompt -----------------------------------------------------------------------------


def template_takes_tools(hf_tokenizer: Any) -> bool:
    """Whether the chat template renders `tools` itself."""
    return "tools" in str(getattr(hf_tokenizer, "chat_template", "") or "")


def chat_turns(
    messages: list[ChatMessage], tools: list[Tool] | None, native: bool
) -> list[dict[str, Any]]:
    """The turns handed to the chat template; tools in a Hermes system message unless native."""
    turns = [_turn(m, native) for m in messages]
    if tools and not native:
        prompt = HERMES_PROMPT.format(
            tools="\n".join(t.model_dump_json(by_alias=True) for t in tools)
        )
        if turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{prompt}"}
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as templates with tool support take them."""
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tools] if tools else None


def _turn(message: ChatMessage, native: bool) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.parts}
    calls = message.tool_calls or []
    if native:
        if calls:
            turn["tool_calls"] = [
                _native_call(c.function.name, c.function.arguments) for c in calls
            ]
        if message.tool_call_id:
            turn["tool_call_id"] = message.tool_call_id
        return turn
    blocks = [_block(c.function.name, c.function.arguments) for c in calls]
    if message.role == "tool":
        turn["content"] = f"<tool_response>\n{message.text}\n</tool_response>"
    elif blocks:
        turn["content"] = "\n".join([message.text, *blocks]).lstrip("\n")
    return turn


def _block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}\n</tool_call>'


def _native_call(name: str, arguments: str) -> dict[str, Any]:
    try:
        parsed: Any = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return {"type": "function", "function": {"name": name, "arguments": parsed}}
