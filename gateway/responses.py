"""OpenAI response shapes: chat completions, completions, their stream chunks, usage, logprobs.

Pure functions of collected results; no HTTP here, so the gRPC text API and
the REST routes build answers the same way.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from gateway.output import ChoiceDelta
from gateway.reasoning import ReasoningParser
from gateway.serving import GenerateJob
from gateway.tokenizer import Tokenizer
from gateway.tools import ToolPlan
from services.types import TokenLogprobs


def new_id(prefix: str) -> str:
    """An OpenAI-style id such as chatcmpl-3f2a..."""
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclass
class ChoiceResult(ChoiceDelta):
    """One choice collected from its deltas (the same fields, accumulated)."""

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class Collector:
    """Accumulates every choice of a job (also used while streaming, for usage)."""

    def __init__(self, job: GenerateJob) -> None:
        self.job = job
        self.choices = {i: ChoiceResult(i) for i, _ in job.choices()}

    def add(self, delta: ChoiceDelta) -> None:
        self.choices[delta.index].add(delta)

    def ordered(self) -> list[ChoiceResult]:
        return [self.choices[i] for i in sorted(self.choices)]

    def usage(self) -> dict[str, Any]:
        n = self.job.options.n
        prompt = sum(len(p) for p in self.job.prompts)
        completion = sum(len(c.token_ids) for c in self.choices.values())
        cached = sum(
            max(self.choices[p * n + j].num_cached_tokens for j in range(n))
            for p in range(len(self.job.prompts))
        )
        return usage_dict(prompt, completion, cached)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# -- chat ------------------------------------------------------------------------------


def chat_response(
    rid: str,
    model: str,
    collector: Collector,
    tok: Tokenizer,
    with_logprobs: bool,
    plan: ToolPlan | None = None,
    reasoning: ReasoningParser | None = None,
) -> dict[str, Any]:
    choices = [
        {
            "index": c.index,
            **chat_message(c, plan, reasoning),
            "logprobs": chat_logprobs(tok, c.logprobs) if with_logprobs else None,
            "stop_reason": c.stop_reason,
        }
        for c in collector.ordered()
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": collector.usage(),
    }


def chat_message(
    choice: ChoiceResult, plan: ToolPlan | None, reasoning: ReasoningParser | None = None
) -> dict[str, Any]:
    """{"message", "finish_reason"} of one choice: its text, or its parsed tool calls; with a
    reasoning parser, the thinking goes to `reasoning_content` and tools are parsed after it.

    A choice that called tools and ended normally finishes with "tool_calls".
    """
    thought, text = reasoning.split(choice.text) if reasoning else (None, choice.text)
    content, calls = plan.parse(text) if plan and text is not None else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = thought
    if not calls:
        return {"message": message, "finish_reason": choice.finish_reason}
    message["tool_calls"] = [c.body() for c in calls]
    finish = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
    return {"message": message, "finish_reason": finish}


def chat_chunk(rid: str, created: int, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def chat_logprobs(
    tok: Tokenizer, entries: list[TokenLogprobs], with_ids: bool = False
) -> dict[str, Any]:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}; each
    entry also holds its `token_id` with `with_ids` (the gRPC API's TokenLogprob)."""
    return {"content": [_chat_entry(tok, e, with_ids) for e in entries]}


def _chat_entry(tok: Tokenizer, entry: TokenLogprobs, with_ids: bool) -> dict[str, Any]:
    top = [
        _token_logprob(tok, t, lp, with_ids)
        for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
    ]
    return {**_token_logprob(tok, entry.token_id, entry.logprob, with_ids), "top_logprobs": top}


def _token_logprob(tok: Tokenizer, token_id: int, logprob: float, with_ids: bool) -> dict[str, Any]:
    text = tok.token_text(token_id)
    entry = {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
    return {**entry, "token_id": token_id} if with_ids else entry


def _finite(value: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(value, -9999.0)


# -- completions -----------------------------------------------------------------------


def completion_response(
    rid: str, model: str, collector: Collector, tok: Tokenizer, echo_texts: dict[int, str]
) -> dict[str, Any]:
    want_logprobs = collector.job.options.logprobs is not None
    choices = []
    for c in collector.ordered():
        prefix = echo_texts.get(c.index, "")
        logprobs = (
            completion_logprobs(tok, collector.job, c, bool(prefix)) if want_logprobs else None
        )
        choice = {
            "index": c.index,
            "text": prefix + c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if collector.job.options.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, collector.job, c)
        choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": collector.usage(),
    }


def completion_chunk(
    rid: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }


def completion_logprobs(
    tok: Tokenizer, job: GenerateJob, choice: ChoiceResult, echo: bool, offset: int = 0
) -> dict[str, Any]:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    entries: list[TokenLogprobs | None] = list(choice.logprobs)
    ids = [e.token_id for e in choice.logprobs]
    if echo:
        prompt = job.prompts[choice.index // job.options.n]
        plp: list[TokenLogprobs | None] = list(choice.prompt_logprobs)
        missing: list[TokenLogprobs | None] = [None] * (len(prompt) - len(plp))
        plp = missing + plp[-len(prompt) :]
        entries, ids = plp + entries, list(prompt) + ids
    return _legacy_logprobs(tok, ids, entries, offset)


def vllm_prompt_logprobs(
    tok: Tokenizer, job: GenerateJob, choice: ChoiceResult
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per prompt token
    {token id: {logprob, rank, decoded_token}}, the prompt's token first, then the top-k."""
    prompt = job.prompts[choice.index // job.options.n]
    entries = list(choice.prompt_logprobs)[-(len(prompt) - 1) :] if len(prompt) > 1 else []
    out: list[dict[str, dict[str, Any]] | None] = [None] * (len(prompt) - len(entries))
    for entry in entries:
        out.append(
            {
                str(t): {"logprob": _finite(lp), "rank": rank, "decoded_token": tok.token_text(t)}
                for t, (lp, rank) in entry.ranked().items()
            }
        )
    return out


def _legacy_logprobs(
    tok: Tokenizer, ids: list[int], entries: list[TokenLogprobs | None], offset: int
) -> dict[str, Any]:
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(ids, entries, strict=True):
        text = tok.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(entry.logprob))
        top = {
            tok.token_text(t): _finite(lp)
            for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
        }
        tops.append({text: _finite(entry.logprob), **top})
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
