"""Stream chunk builders for chat and completions (`chat.completion.chunk`, `text_completion`).

A builder turns each `ChoiceDelta` into one chunk (or None when there is
nothing to send), may send opening chunks (the chat role), and builds the
final usage chunk of `stream_options.include_usage`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from gateway import responses as rs
from gateway.output import ChoiceDelta
from gateway.reasoning import ReasoningParser, ReasoningStream
from gateway.serving import GenerateJob
from gateway.tokenizer import Tokenizer
from gateway.tools import ToolPlan, ToolStream


class ChunkBuilder(Protocol):
    def opening(self) -> list[dict[str, Any]]: ...

    def build(self, delta: ChoiceDelta) -> list[dict[str, Any]]: ...

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]: ...


class ChatChunks:
    """Chat: the role in a first chunk per choice, content or tool_calls deltas, finish last."""

    def __init__(
        self,
        rid: str,
        model: str,
        tok: Tokenizer,
        logprobs: bool,
        n: int = 1,
        plan: ToolPlan | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.rid, self.model, self.tok, self.logprobs = rid, model, tok, logprobs
        self.n = n
        self.created = int(time.time())
        self.tools = {i: ToolStream(plan) for i in range(n)} if plan else {}
        self.thoughts = {i: ReasoningStream(reasoning) for i in range(n)} if reasoning else {}

    def opening(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [self._chunk([rs.chat_chunk_choice(i, role, None, None)]) for i in range(self.n)]

    def build(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """Reasoning deltas first (with --reasoning-parser), then content or tool calls."""
        text, finish, parts = delta.text, delta.finish_reason, []
        thoughts = self.thoughts.get(delta.index)
        if thoughts is not None:
            thought, text = _joined(thoughts.feed(text), thoughts.finish() if finish else None)
            parts = [{"reasoning_content": thought}] if thought else []
        tools = self.tools.get(delta.index)
        if tools is not None:
            parts += tools.feed(text)
            if finish is not None:
                rest, called = tools.finish()
                parts += rest
                finish = "tool_calls" if called and finish == "stop" else finish
        elif text:
            parts.append({"content": text})
        if not parts and (delta.logprobs or finish):
            parts = [{}]
        last = len(parts) - 1
        return [
            self._choice(delta, part, finish if k == last else None, with_logprobs=k == 0)
            for k, part in enumerate(parts)
        ]

    def _choice(
        self,
        delta: ChoiceDelta,
        part: dict[str, Any],
        finish: str | None,
        with_logprobs: bool = True,
    ) -> dict[str, Any]:
        logprobs = None
        if self.logprobs and with_logprobs:
            logprobs = rs.chat_logprobs(self.tok, delta.logprobs)
        return self._chunk([rs.chat_chunk_choice(delta.index, part, logprobs, finish)])

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return rs.chat_chunk(self.rid, self.created, self.model, choices)


class CompletionChunks:
    """Completions: text deltas (the echoed prompt first), finish_reason last."""

    def __init__(self, job: GenerateJob, model: str, tok: Tokenizer, echo: dict[int, str]) -> None:
        self.job, self.model, self.tok = job, model, tok
        self.echo = dict(echo)  # popped when sent
        self.offsets: dict[int, int] = {}
        self.created = int(time.time())

    def opening(self) -> list[dict[str, Any]]:
        return []

    def build(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        prefix = self.echo.pop(delta.index, "")
        if not (prefix or delta.text or delta.logprobs or delta.finish_reason):
            return []
        choice = {
            "index": delta.index,
            "text": prefix + delta.text,
            "logprobs": self._logprobs(delta, bool(prefix)),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        return [rs.completion_chunk(self.job.request_id, self.created, self.model, [choice])]

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = rs.completion_chunk(self.job.request_id, self.created, self.model, [])
        return {**chunk, "usage": usage}

    def _logprobs(self, delta: ChoiceDelta, echo: bool) -> dict[str, Any] | None:
        if self.job.options.logprobs is None:
            return None
        part = rs.ChoiceResult(
            delta.index, logprobs=delta.logprobs, prompt_logprobs=delta.prompt_logprobs
        )
        offset = self.offsets.get(delta.index, 0)
        result = rs.completion_logprobs(self.tok, self.job, part, echo, offset)
        self.offsets[delta.index] = offset + sum(len(t) for t in result["tokens"])
        return result


def _joined(first: tuple[str, str], more: tuple[str, str] | None) -> tuple[str, str]:
    return first if more is None else (first[0] + more[0], first[1] + more[1])
