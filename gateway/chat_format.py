"""How message content reaches the chat template (vLLM's `--chat-template-content-format`).

"openai": every message's content is a list of parts ({"type": "text", "text": ...},
{"type": "image"}), a string becoming one text part; templates that iterate over a message's
content (LLaVA's, Idefics3's, Qwen2-VL's) need this, as HF's processors are given it.
"string": content is a string, the text parts joined; messages holding images keep their
parts. "auto" reads the template: a loop over, or an index into, a message's content means
"openai".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")

# `{% for part in message['content'] %}`, `... in message.content | selectattr(...)`,
# `message['content'][0]['type']`: the template walks the parts of a message's content.
_WALKS_PARTS = re.compile(
    r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)"
    r"|\w+\[\s*['\"]content['\"]\s*\]\s*\[\s*\d"
)


def detect_content_format(template: str | None, requested: str = "auto") -> ContentFormat:
    """`requested` unless "auto"; then "openai" for templates that walk content parts."""
    if requested in ("string", "openai"):
        return requested  # type: ignore[return-value]
    return "openai" if template and _WALKS_PARTS.search(template) else "string"


def shaped(messages: Sequence[dict[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """The messages with their content in `fmt`."""
    return [
        {**m, "content": _content(m.get("content"), fmt)} if "content" in m else dict(m)
        for m in messages
    ]


def _content(content: Any, fmt: ContentFormat) -> Any:
    if fmt == "openai":
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        return content
    if isinstance(content, list) and all(_is_text(p) for p in content):
        return "".join(p.get("text") or "" for p in content)
    return content


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text"
