"""The public gRPC API's messages <-> the REST request models and answers.

Requests: a `CompletionRequest` / `ChatRequest` proto becomes the JSON body REST would
get for it, parsed by the same pydantic models (gateway.protocol), so every field has one
validation, one mapping to SamplingParams and one error message. Answers: the same
builders as REST (gateway.responses: the logprob entries, the tool-call parsing of
`chat_message`; gateway.chunks.ChatChunks for streamed tool calls and reasoning), written
as protos.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gateway import responses as rs
from gateway.chunks import ChatChunks
from gateway.errors import InvalidRequest
from gateway.output import ChoiceDelta
from gateway.prepare import Prepared
from gateway.protocol import ChatCompletionRequest, CompletionRequest, parse
from gateway.tokenizer import Tokenizer
from services.config import RequestLimits
from services.pb import generate_pb2 as pb
from services.types import TokenLogprobs

_OPTIONAL = (
    "max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "n", "skip_special_tokens"
)  # fmt: skip
_PLAIN = (
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens",
    "include_stop_str_in_output",
)  # fmt: skip

# -- requests ---------------------------------------------------------------------------


def sampling_body(params: pb.TextSamplingParams) -> dict[str, Any]:
    """The sampling params as REST body fields (logprobs as chat takes them)."""
    message: Any = params  # HasField takes the field names as literals in the stubs
    body: dict[str, Any] = {name: getattr(params, name) for name in _PLAIN}
    body.update({n: getattr(params, n) for n in _OPTIONAL if message.HasField(n)})
    body["stop"] = list(params.stop)
    body["stop_token_ids"] = list(params.stop_token_ids)
    body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    body["logprobs"] = params.logprobs
    if message.HasField("top_logprobs"):
        body["top_logprobs"] = params.top_logprobs
    if message.HasField("structured_outputs"):
        body["structured_outputs"] = _constraint(params.structured_outputs)
    return body


def _constraint(so: pb.StructuredOutputs) -> dict[str, Any]:
    kind = so.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequest(
            "'structured_outputs' must set one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    value = list(so.choice.values) if kind == "choice" else getattr(so, kind)
    return {kind: value}


def chat_request(request: pb.ChatRequest, limits: RequestLimits) -> ChatCompletionRequest:
    """The REST model of a gRPC chat request (400 -> INVALID_ARGUMENT as REST answers)."""
    body = {**sampling_body(request.params), "messages": messages_body(request.messages)}
    body.update(model=request.model, priority=request.priority)
    if request.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(request.tools)]
    choice = request.tool_choice.WhichOneof("choice")
    if choice == "mode":
        body["tool_choice"] = request.tool_choice.mode
    elif choice == "function":
        body["tool_choice"] = {
            "type": "function",
            "function": {"name": request.tool_choice.function},
        }
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return parse(ChatCompletionRequest, body, limits)


def completion_request(
    request: pb.CompletionRequest, limits: RequestLimits
) -> tuple[CompletionRequest, Any]:
    """The REST model of a gRPC completions request and its options (TextOptions); an
    unset max_tokens means up to the context length here, not REST's 16."""
    body = sampling_body(request.params)
    if body.pop("top_logprobs", None) is not None and not body["logprobs"]:
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    message: Any = request.params
    top = request.params.top_logprobs if message.HasField("top_logprobs") else 0
    body["logprobs"] = top if body["logprobs"] else None
    body.update(model=request.model, priority=request.priority, prompt=request.prompt)
    req = parse(CompletionRequest, body, limits)
    options = req.options()
    if not message.HasField("max_tokens"):
        options = replace(options, max_tokens=None)
    return req, options


def messages_body(messages: Sequence[pb.ChatMessage]) -> list[dict[str, Any]]:
    """The turns as REST's `messages`: parts in order, images as image_url parts."""
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": m.role}
    turn["content"] = [_part(i, p) for p in m.parts] if m.parts else m.content
    if m.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def _part(i: int, part: pb.ContentPart) -> dict[str, Any]:
    if part.WhichOneof("part") != "image":
        return {"type": "text", "text": part.text}
    image = part.image
    if bool(image.data) == bool(image.url):
        raise InvalidRequest(
            f"'messages[{i}]': an image needs data or url, one of the two", "messages"
        )
    url = image.url or (
        f"data:{image.mime_type or 'image/png'};base64,{base64.b64encode(image.data).decode()}"
    )
    return {"type": "image_url", "image_url": {"url": url}}


def image_count(messages: Sequence[pb.ChatMessage]) -> int:
    """Images in a chat, counted on the proto (before any is converted)."""
    return sum(p.WhichOneof("part") == "image" for m in messages for p in m.parts)


def _tool(i: int, tool: pb.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except ValueError as exc:
            raise InvalidRequest(
                f"'tools[{i}].parameters' must be a JSON schema as JSON text: {exc}", "tools"
            ) from None
    return {"type": "function", "function": function}


# -- answers ----------------------------------------------------------------------------


def token_logprobs(tok: Tokenizer, entries: list[TokenLogprobs]) -> list[pb.TokenLogprob]:
    """The REST logprob entries (gateway.responses.chat_logprobs) as protos."""
    return [_logprob(e) for e in rs.chat_logprobs(tok, entries, with_ids=True)["content"]]


def _logprob(entry: dict[str, Any]) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token=entry["token"],
        token_id=entry["token_id"],
        logprob=entry["logprob"],
        bytes=bytes(entry["bytes"]),
        top_logprobs=[_logprob(t) for t in entry.get("top_logprobs", [])],
    )


def stop_reason(reason: int | str | None) -> dict[str, Any]:
    """The stop_reason oneof of GenerateChoice / GenerateChunk as keyword arguments."""
    if isinstance(reason, str):
        return {"stop_string": reason}
    return {} if reason is None else {"stop_token_id": reason}


def choice(prepared: Prepared, c: rs.ChoiceResult, tok: Tokenizer) -> pb.GenerateChoice:
    """One whole choice; chat text goes through REST's tool-call and reasoning parsing."""
    text, finish, calls, thought = c.text, c.finish_reason, [], None
    if prepared.chat:
        parsed = rs.chat_message(c, prepared.plan, prepared.reasoning)
        message, finish = parsed["message"], parsed["finish_reason"]
        text, thought = message["content"] or "", message.get("reasoning_content")
        calls = [_call(k, call) for k, call in enumerate(message.get("tool_calls", []))]
    with_logprobs = prepared.job.options.logprobs is not None
    return pb.GenerateChoice(
        index=c.index,
        text=text,
        finish_reason=finish or "",
        logprobs=token_logprobs(tok, c.logprobs) if with_logprobs else [],
        tool_calls=calls,
        reasoning_content=thought,
        **stop_reason(c.stop_reason),
    )


def _call(index: int, call: dict[str, Any]) -> pb.ToolCall:
    function = call.get("function", {})
    return pb.ToolCall(
        index=call.get("index", index),
        id=call.get("id", ""),
        name=function.get("name", ""),
        arguments=function.get("arguments", ""),
    )


def usage(collector: rs.Collector) -> pb.Usage:
    u = collector.usage()
    return pb.Usage(
        prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
        total_tokens=u["total_tokens"], cached_tokens=u["prompt_tokens_details"]["cached_tokens"],
    )  # fmt: skip


class Chunks:
    """The GenerateChunks of a stream: per choice `index`, chat text through REST's
    ChatChunks (tool-call deltas, reasoning), logprobs on a delta's first chunk, usage on
    the chunk that ends the last choice."""

    def __init__(self, prepared: Prepared, rid: str, tok: Tokenizer) -> None:
        self.rid, self.tok = rid, tok
        self.logprobs = prepared.job.options.logprobs is not None
        n = prepared.job.options.n * len(prepared.job.prompts)
        self.unfinished = set(range(n))
        self.chat = (
            ChatChunks(rid, prepared.model, tok, False, n, prepared.plan, prepared.reasoning)
            if prepared.chat
            else None
        )

    def build(self, delta: ChoiceDelta, collector: rs.Collector) -> list[pb.GenerateChunk]:
        parts = self._parts(delta)
        if not parts:
            return []
        if self.logprobs and delta.logprobs:
            parts[0].logprobs.extend(token_logprobs(self.tok, delta.logprobs))
        if delta.finish_reason is not None:
            self.unfinished.discard(delta.index)
            last = parts[-1]
            last.MergeFrom(pb.GenerateChunk(**stop_reason(delta.stop_reason)))
            if not self.unfinished:
                last.usage.CopyFrom(usage(collector))
        return parts

    def _parts(self, delta: ChoiceDelta) -> list[pb.GenerateChunk]:
        if self.chat is None:
            if not (delta.text or delta.logprobs or delta.finish_reason):
                return []
            return [
                pb.GenerateChunk(
                    id=self.rid,
                    index=delta.index,
                    text=delta.text,
                    finish_reason=delta.finish_reason or "",
                )
            ]
        return [self._chat_part(c["choices"][0]) for c in self.chat.build(delta)]

    def _chat_part(self, built: dict[str, Any]) -> pb.GenerateChunk:
        part = built["delta"]
        return pb.GenerateChunk(
            id=self.rid,
            index=built["index"],
            text=part.get("content") or "",
            reasoning_content=part.get("reasoning_content") or "",
            tool_calls=[_call(0, c) for c in part.get("tool_calls", [])],
            finish_reason=built["finish_reason"] or "",
        )
