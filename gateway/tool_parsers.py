"""Tool-call formats of `tool_choice: "auto"` (`--tool-call-parser`), as vLLM's parsers read them:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5/3,
  Hermes, SmolLM); content is the text before the first block.
- llama3_json: the output is one or more JSON objects `{"name", "parameters" | "arguments"}`
  (optionally after `<|python_tag|>`, joined by "; "); with any call there is no content.
- mistral: `content[TOOL_CALLS][{"name", "arguments"}, ...]`, or the v11 form
  `[TOOL_CALLS]name{args}` per call; ids are 9 alphanumerics as Mistral's tokenizer requires.
- qwen3_coder: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>`; values are typed by the tool's parameter schema.

Each format says where a call may start (streamed text is held back from there) and parses a
whole output into (content, [(name, arguments JSON)]). `auto` picks the format from the
tokenizer's special tokens and chat template.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.reasoning import partial_tag

Parsed = tuple[str | None, list[tuple[str, str]]]  # content, [(name, arguments)]

HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_OPEN = "[TOOL_CALLS]"
_MISTRAL_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)
FUNCTION_OPEN = "<function="
_XML_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_XML_PARAMETER = re.compile(
    r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL
)


@dataclass(frozen=True)
class ToolFormat:
    """One model family's tool-call syntax."""

    name: str
    call_start: Callable[[str], int]  # index where calls begin in the text so far; -1: none yet
    held: Callable[[str], int]  # characters at the end that may begin a call marker
    parse: Callable[[str, Sequence[Any]], Parsed]  # whole output, the request's tools
    call_id: Callable[[], str] = lambda: f"call_{secrets.token_hex(12)}"


def json_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


# -- hermes -------------------------------------------------------------------------------


def _hermes(text: str, tools: Sequence[Any]) -> Parsed:
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            item = json.loads(block)
        except ValueError:
            continue
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append(
                (item["name"], json_text(item.get("arguments", item.get("parameters", {}))))
            )
    if not calls:
        return text, []
    content = text.split(HERMES_OPEN, 1)[0]
    return content or None, calls


# -- llama3_json ----------------------------------------------------------------------------


def _llama3(text: str, tools: Sequence[Any]) -> Parsed:
    decoder, calls, end = json.JSONDecoder(), [], -1
    for match in re.finditer(r"\{", text):
        if match.start() <= end:
            continue  # a brace inside an object already read
        try:
            item, length = decoder.raw_decode(text[match.start() :])
            end = match.start() + length
            arguments = item["arguments"] if "arguments" in item else item["parameters"]
            calls.append((str(item["name"]), json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, KeyError, TypeError):
            return text, []  # vLLM: any malformed object -> the whole output is content
    return (None, calls) if calls else (text, [])


def _llama3_start(text: str) -> int:
    return 0 if text.startswith((PYTHON_TAG, "{")) else -1


def _llama3_held(text: str) -> int:
    return len(text) if PYTHON_TAG.startswith(text) else 0


# -- mistral ------------------------------------------------------------------------------


def _mistral(text: str, tools: Sequence[Any]) -> Parsed:
    if MISTRAL_OPEN not in text:
        return text, []
    content, *raw = text.split(MISTRAL_OPEN)
    body = raw[0].strip() if raw else ""
    if len(raw) == 1 and body.startswith("["):  # before tokenizer v11: one JSON array
        try:
            items = json.loads(body)
        except ValueError:
            found = _MISTRAL_ARRAY.findall(body)
            try:
                items = json.loads(found[0]) if found else None
            except ValueError:
                items = None
            if items is None:
                return body, []
        try:
            calls = [
                (str(i["name"]), json.dumps(i["arguments"], ensure_ascii=False)) for i in items
            ]
        except (KeyError, TypeError):
            return text, []
    else:  # v11: name{args} after each marker
        calls = [(call[: call.find("{")], call[call.find("{") :]) for call in raw if "{" in call]
    return content or None, calls


def _mistral_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


# -- qwen3_coder ----------------------------------------------------------------------------


def _qwen3_coder(text: str, tools: Sequence[Any]) -> Parsed:
    if FUNCTION_OPEN not in text:
        return text, []
    blocks = [a or b for a, b in _XML_CALL.findall(text)] or [text]
    functions = [a or b for block in blocks for a, b in _XML_FUNCTION.findall(block)]
    if not functions:
        return text, []
    calls = [_xml_call(function, tools) for function in functions]
    cut = text.find(HERMES_OPEN)
    content = text[: cut if cut >= 0 else text.find(FUNCTION_OPEN)]
    return content or None, calls


def _xml_call(function: str, tools: Sequence[Any]) -> tuple[str, str]:
    name, _, body = function.partition(">")
    schema = _properties(name, tools)
    arguments = {}
    for match in _XML_PARAMETER.findall(body):
        key, _, value = match.partition(">")
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = _typed(value, schema.get(key))
    return name, json.dumps(arguments, ensure_ascii=False)


def _properties(name: str, tools: Sequence[Any]) -> dict[str, Any]:
    for tool in tools:
        if tool.function.name == name:
            params = tool.function.parameters or {}
            return dict(params.get("properties", params)) if isinstance(params, dict) else {}
    return {}


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text converted to its schema type (vLLM's rules; the text if it fails)."""
    if value.lower() == "null":
        return None
    kind = str(schema.get("type", "string")).strip().lower() if isinstance(schema, dict) else ""
    if not kind or kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            return int(number) if number == int(number) else number
    except (ValueError, OverflowError):
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _xml_start(text: str) -> int:
    cut = text.find(HERMES_OPEN)
    return cut if cut >= 0 else text.find(FUNCTION_OPEN)


FORMATS = {
    "hermes": ToolFormat(
        "hermes", lambda t: t.find(HERMES_OPEN), lambda t: partial_tag(t, HERMES_OPEN), _hermes
    ),
    "llama3_json": ToolFormat("llama3_json", _llama3_start, _llama3_held, _llama3),
    "mistral": ToolFormat(
        "mistral",
        lambda t: t.find(MISTRAL_OPEN),
        lambda t: partial_tag(t, MISTRAL_OPEN),
        _mistral,
        _mistral_id,
    ),
    "qwen3_coder": ToolFormat(
        "qwen3_coder",
        _xml_start,
        lambda t: max(partial_tag(t, HERMES_OPEN), partial_tag(t, FUNCTION_OPEN)),
        _qwen3_coder,
    ),
}


def detect(hf_tokenizer: Any) -> str:
    """`--tool-call-parser auto`: the format the model family writes, from its tokenizer."""
    template = str(getattr(hf_tokenizer, "chat_template", "") or "")
    vocab = hf_tokenizer.get_vocab() if hasattr(hf_tokenizer, "get_vocab") else {}
    if MISTRAL_OPEN in vocab or MISTRAL_OPEN in template:
        return "mistral"
    if FUNCTION_OPEN in template and "<parameter=" in template:
        return "qwen3_coder"
    if PYTHON_TAG in vocab:
        return "llama3_json"
    return "hermes"
