"""The OpenAI request bodies the gateway serves, declared once as pydantic v2 models.

Validation (strict types, ranges, unknown fields), the 400 error of a bad field and the
request half of /openapi.json all follow from these models. `parse(Model, data)` turns
a decoded JSON object into a model or raises `InvalidRequest` naming the field.
Fields Tessera does not implement are refused with a 400 naming them (extra="forbid")
rather than silently dropped; a field sent as JSON null counts as absent.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core.core_schema import ValidationInfo

from gateway.constraints import GuidedFields
from gateway.errors import InvalidRequest
from gateway.limits import chat_size, stop_size, template_kwargs
from gateway.options import TextOptions, within_limit
from gateway.strict import Strict
from services.config import RequestLimits
from services.types import MAX_LOGPROBS, MAX_N

MAX_PROMPTS = 64  # prompts in one completions request
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
Role = Literal["system", "user", "assistant", "developer", "tool"]
ROLES: tuple[str, ...] = get_args(Role)

M = TypeVar("M", bound=BaseModel)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # logit_bias keys: token ids
Penalty = Annotated[float | None, Field(ge=-2, le=2)]


class StreamOptions(Strict):
    include_usage: bool | None = None


class SamplingFields(GuidedFields):
    """Sampling, stopping and streaming fields shared by chat and completions."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: Annotated[str | list[str] | None, BeforeValidator(stop_size)] = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    logit_bias: dict[TokenKey, Annotated[float, Field(ge=-100, le=100)]] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = Field(None, ge=-INT32_MAX - 1, le=INT32_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Informational only, accepted because clients send them and honouring them changes
    # nothing in the answer: an end-user id for abuse tracking, and tags for stored
    # completions. `store` and `service_tier` are accepted only with the values Tessera
    # actually provides (nothing is stored; one tier).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default"] | None = None
    # Seconds before the server aborts the request (408); the shorter of this and
    # --request-timeout wins. A Tessera extension (the openai SDKs send it in extra_body).
    timeout: float | None = Field(None, gt=0)

    @field_validator("n")
    @classmethod
    def _n_allowed(cls, n: int | None, info: ValidationInfo) -> int | None:
        return within_limit(n, info, "max_n")

    @field_validator("store")
    @classmethod
    def _not_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("'store' cannot be true: this server stores no completions")
        return store

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def text_options(self, max_tokens: int | None, logprobs: int | None) -> TextOptions:
        """The options shared by every API, with defaults for absent fields."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return TextOptions(
            max_tokens=max_tokens, logprobs=logprobs,
            temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0), min_p=_or(self.min_p, 0.0), seed=self.seed,
            stop=tuple(s for s in stop if s), stop_token_ids=tuple(self.stop_token_ids or ()),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            ignore_eos=bool(self.ignore_eos), min_tokens=_or(self.min_tokens, 0),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=_or(self.skip_special_tokens, True), n=_or(self.n, 1),
            priority=_or(self.priority, 0), structured_output=self.constraint(),
            timeout_s=self.timeout,
        )  # fmt: skip


# -- chat messages ------------------------------------------------------------------------


class ImageUrl(Strict):
    url: str
    detail: str | None = None


class ContentPart(Strict):
    """One part of a message's content: text or an image."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None

    @model_validator(mode="after")
    def _has_payload(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("'text' is required in a text part")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("'image_url' (an object with a 'url' string) is required")
        return self


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    """A tool call of an earlier assistant turn."""

    id: str
    type: Literal["function"] | None = None  # always "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None  # a participant's name: informational, the template has no slot
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers
    refusal: str | None = None  # echoed back by clients that resend an assistant message

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)

    @property
    def parts(self) -> str | list[dict[str, Any]]:
        """The content as chat templates take it: the string, or its parts in order with
        images as {"type": "image"} (gateway.chat_format shapes it for the template)."""
        if not isinstance(self.content, list):
            return self.content or ""
        return [
            {"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text or ""}
            for p in self.content
        ]


class FunctionDef(Strict):
    """A tool's function: its name, what it does, and a JSON schema of its arguments."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    """tool_choice that forces one function."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], BeforeValidator(chat_size)] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: Annotated[dict[str, Any] | None, BeforeValidator(template_kwargs)] = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_allowed(cls, value: int | None, info: ValidationInfo) -> int | None:
        return within_limit(value, info, "max_logprobs")

    @model_validator(mode="after")
    def _cross_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs' to be true")
        names = [t.function.name for t in self.tools or []]
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise ValueError("'tool_choice' requires 'tools'")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"'tool_choice' names the function {choice.function.name!r:.80},"
                " which is not in 'tools'"
            )
        return self

    @property
    def has_images(self) -> bool:
        return any(m.has_images for m in self.messages)

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """ "none" without tools; OpenAI's default ("auto") with them."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    def options(self) -> TextOptions:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self.text_options(max_tokens, logprobs)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[Annotated[list[TokenId], Field(min_length=1)]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's field

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs_allowed(cls, value: int | None, info: ValidationInfo) -> int | None:
        return within_limit(value, info, "max_logprobs")

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> CompletionRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("'prompt_logprobs' are not available when 'stream' is true")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt_size(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("'prompt' must not be empty")
            if isinstance(prompt[0], str | list) and len(prompt) > MAX_PROMPTS:
                raise ValueError(f"'prompt' may hold at most {MAX_PROMPTS} prompts")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]

    def options(self) -> TextOptions:
        options = self.text_options(_or(self.max_tokens, 16), self.logprobs)
        return replace(options, prompt_logprobs=self.prompt_logprobs)


class TokenizeRequest(Strict):
    """POST /tokenize: a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, BeforeValidator(chat_size)] = Field(
        None, min_length=1
    )
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if self.prompt is None and self.messages is None:
            raise ValueError("give 'prompt' (a string) or 'messages'")
        return self


class DetokenizeRequest(Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


# -- parsing and errors -----------------------------------------------------------------


def parse(model: type[M], data: dict[str, Any], limits: RequestLimits | None = None) -> M:
    """`data` validated as `model` under the server's per-request `limits` (the defaults
    without); InvalidRequest naming the first bad field otherwise."""
    try:
        return model.model_validate(data, context={"limits": limits or RequestLimits()})
    except ValidationError as exc:
        raise invalid_request(exc) from None


def invalid_request(exc: ValidationError) -> InvalidRequest:
    """The most specific error of `exc` (its deepest field) as OpenAI's 400."""
    errors = exc.errors(include_url=False)
    per_branch = Counter(_branch(e["loc"]) for e in errors)  # fewer: the closer union member
    error = max(errors, key=lambda e: (len(_path_parts(e)), -per_branch[_branch(e["loc"])]))
    path = "".join(_path_parts(error)).lstrip(".")
    message = _message(error)
    if not path:  # a cross-field check names its field first: "'top_logprobs' requires..."
        named = re.match(r"'([\w.\[\]]+)'", message)
        return InvalidRequest(message, named.group(1) if named else None)
    if message.startswith(f"'{path}' "):  # a field check that names its field itself
        return InvalidRequest(message, path)
    return InvalidRequest(f"'{path}' {message}", path)


def _branch(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """The location up to its last union-member tag (the member the error belongs to)."""
    tags = [i for i, p in enumerate(loc) if not isinstance(p, int) and p not in _names()]
    return loc[: tags[-1] + 1] if tags else ()


def _path_parts(error: Any) -> list[str]:
    """Field names and indexes of an error's location, without union-member tags."""
    loc = error["loc"]
    parts = [
        f"[{p}]" if isinstance(p, int) else f".{p}"
        for p in loc
        if p in _names() or isinstance(p, int)
    ]
    if error["type"] == "extra_forbidden":  # the unknown field itself
        parts.append(f".{loc[-1]}")
    return parts


_TYPES = {
    "model_type": "an object", "dict_type": "an object", "string_type": "a string",
    "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
    "list_type": "an array",
}  # fmt: skip


def _message(error: Any) -> str:
    kind, msg, value = error["type"], error["msg"], error.get("input")
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not supported by this server"
    if kind == "too_short" and error.get("ctx", {}).get("min_length") == 1:
        return "must be a non-empty array" if isinstance(value, list) else "must not be empty"
    if kind == "value_error":
        return str(msg).removeprefix("Value error, ")
    if kind in _TYPES:
        return f"must be {_TYPES[kind]}, not {_json_type(value)}"
    shown = "" if isinstance(value, dict | list) else f" (got {value!r:.40})"
    return f"{msg[:1].lower()}{msg[1:]}{shown}"


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    names = {str: "a string", int: "a number", float: "a number", list: "an array"}
    return names.get(type(value), "an object")


_NAMES: set[str] = set()


def _names() -> set[str]:
    """Every field name (and alias) of the request models."""
    if not _NAMES:
        todo: list[type[BaseModel]] = [Strict]
        while todo:
            model = todo.pop()
            for name, info in model.model_fields.items():
                _NAMES.update({name, info.alias or name})
            todo.extend(model.__subclasses__())
    return _NAMES


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
