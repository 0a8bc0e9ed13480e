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
from gateway.serving import GenerateJob
from gateway.tokenizer import Tokenizer


class ChunkBuilder(Protocol):
    def opening(self) -> list[dict[str, Any]]: ...

    def build(self, delta: ChoiceDelta) -> dict[str, Any] | None: ...

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]: ...


class ChatChunks:
    """Chat: the role in a first chunk per choice, content deltas, finish_reason last."""

    def __init__(self, rid: str, model: str, tok: Tokenizer, logprobs: bool, n: int = 1) -> None:
        self.rid, self.model, self.tok, self.logprobs = rid, model, tok, logprobs
        self.n = n
        self.created = int(time.time())

    def opening(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [self._chunk([rs.chat_chunk_choice(i, role, None, None)]) for i in range(self.n)]

    def build(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        if not (delta.text or delta.logprobs or delta.finish_reason):
            return None
        content = {"content": delta.text} if delta.text else {}
        logprobs = rs.chat_logprobs(self.tok, delta.logprobs) if self.logprobs else None
        choice = rs.chat_chunk_choice(delta.index, content, logprobs, delta.finish_reason)
        return self._chunk([choice])

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

    def build(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        prefix = self.echo.pop(delta.index, "")
        if not (prefix or delta.text or delta.logprobs or delta.finish_reason):
            return None
        choice = {
            "index": delta.index,
            "text": prefix + delta.text,
            "logprobs": self._logprobs(delta, bool(prefix)),
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        return rs.completion_chunk(self.job.request_id, self.created, self.model, [choice])

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
