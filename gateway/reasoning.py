"""Reasoning parsers (`--reasoning-parser`): a thinking model's `<think>...</think>` text goes
to the message's `reasoning_content`, the rest to `content`, as vLLM's parsers split it.

Both parsers strip a `<think>` the model writes itself (templates that open the block in the
prompt leave only `</think>` in the output) and put everything before `</think>` into the
reasoning. Output that never closes the block is all reasoning (it was cut short), except
with `qwen3` when the request turned thinking off (`chat_template_kwargs:
{"enable_thinking": false}`): then it is all content. Streamed, the same split arrives as
`reasoning_content` deltas, then `content` deltas; a tag cut across two deltas is held back
until it is whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """How one request's output splits into reasoning and content."""

    name: str
    thinking: bool = True  # False: the prompt turned thinking off (qwen3's enable_thinking)

    @classmethod
    def for_request(cls, name: str, template_kwargs: dict[str, Any] | None) -> ReasoningParser:
        kwargs = template_kwargs or {}
        thinking = name != "qwen3" or kwargs.get("enable_thinking", True) is not False
        return cls(name, thinking)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None where a part is empty."""
        head, tag, tail = text.partition(START)
        text = tail if tag else head
        if END in text:
            reasoning, _, content = text.partition(END)
            return reasoning, content or None
        if not self.thinking:
            return None, text
        return text, None


class ReasoningStream:
    """The streamed form of `ReasoningParser.split`: feed text deltas, get (reasoning, content)
    pieces whose concatenations equal the split of the whole output."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.in_reasoning = parser.thinking
        self.pending = ""  # held back: may be the start of a tag
        self.start_seen = False

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        text = self.pending + text
        if not self.start_seen and START in text:
            head, _, tail = text.partition(START)
            text, self.start_seen = head + tail, True
        if END in text:
            reasoning, _, content = text.partition(END)
            self.in_reasoning, self.pending = False, ""
            return reasoning, content
        keep = (
            partial_tag(text, END)
            if self.start_seen
            else max(partial_tag(text, END), partial_tag(text, START))
        )
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.in_reasoning else ("", rest)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
