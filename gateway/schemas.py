"""The response bodies the gateway serves, declared as pydantic models for /openapi.json.

gateway.responses and gateway.chunks build these shapes; the schemathesis suite checks
every live answer against the document generated from them (extra fields refused), so
the two cannot drift apart.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Shape(BaseModel):
    """A response object: exactly these fields."""

    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(Shape):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCallOut(Shape):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Shape):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(Shape):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class ChatChoice(Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None  # the stop token id or string that ended it


class ChatCompletion(Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(Shape):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Shape):
    """A call's first delta has id, type and function.name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatDelta(Shape):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Shape):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(Shape):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class Completion(Shape):
    """A text completion, or (with usage only on the last) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCardOut(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelCardOut]


class EmbeddingUsage(Shape):
    prompt_tokens: int
    total_tokens: int


class Embedding(Shape):
    object: Literal["embedding"]
    index: int
    # The vector as numbers, or (encoding_format "base64") its little-endian float32 bytes.
    embedding: list[float] | str


class EmbeddingList(Shape):
    """The answer of POST /v1/embeddings: one entry per input, in order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class TokenizeResponse(Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str]


class DetokenizeResponse(Shape):
    prompt: str


class ErrorDetail(Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Shape):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class HealthResponse(Shape):
    status: Literal["ok"]


class VersionResponse(Shape):
    version: str
