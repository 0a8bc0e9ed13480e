"""OpenAI request bodies parsed and validated into gateway request objects.

`parse_chat` / `parse_completion` / `parse_tokenize` / `parse_detokenize` turn a
decoded JSON object into frozen dataclasses or raise `InvalidRequest` naming the
field. `TextOptions` is the protocol-neutral set of sampling and stopping
options shared with the gRPC text API; `TextOptions.sampling_params` checks
them against the model (vocabulary, context length) and builds SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import InvalidRequest
from gateway.fields import INT32_MAX, Fields
from services.types import MAX_LOGPROBS, SamplingParams

MAX_N = 64  # choices per request
MAX_STOP = 16  # stop strings per request
MAX_PROMPTS = 64  # prompts in one completions request
ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True)
class TextOptions:
    """Sampling and stopping options in text terms (REST and gRPC)."""

    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    priority: int = 0

    def sampling_params(
        self, prompt_len: int, max_model_len: int, vocab_size: int, prompt_logprobs: bool = False
    ) -> SamplingParams:
        """SamplingParams for one engine request; 400 when the request cannot fit."""
        self._check_ids(vocab_size)
        max_tokens = self._max_tokens(prompt_len, max_model_len)
        if self.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens"
            )
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            logprobs=self.logprobs, prompt_logprobs=self.logprobs if prompt_logprobs else None,
        )  # fmt: skip

    def _max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        room = max_model_len - prompt_len
        wanted = self.max_tokens if self.max_tokens is not None else room
        if room < 1 or wanted > room:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + max(wanted, 1)} tokens ({prompt_len} in the prompt, "
                f"{max(wanted, 1)} for the completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )
        return wanted

    def _check_ids(self, vocab_size: int) -> None:
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequest(
                    f"'{name}' holds token id {bad[0]}, outside the vocabulary (size {vocab_size})",
                    name,
                )


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]  # {"role", "content": str} after flattening text parts
    options: TextOptions
    stream: bool = False
    include_usage: bool = False
    has_images: bool = False
    user: str | None = None


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    options: TextOptions
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


def parse_chat(data: dict[str, Any]) -> ChatRequest:
    f = Fields(data)
    messages, has_images = parse_messages(f)
    top = f.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    logprobs = (top or 0) if f.boolean("logprobs", False) else None
    legacy_max = f.integer("max_tokens", None, 1)  # both are checked; the new name wins
    max_tokens = f.integer("max_completion_tokens", legacy_max, 1)
    stream, include_usage = _stream_options(f)
    return ChatRequest(
        model=f.string("model"),
        messages=messages,
        options=parse_options(f, max_tokens, logprobs),
        stream=stream,
        include_usage=include_usage,
        has_images=has_images,
        user=f.string("user"),
    )


def parse_completion(data: dict[str, Any]) -> CompletionRequest:
    f = Fields(data)
    stream, include_usage = _stream_options(f)
    return CompletionRequest(
        model=f.string("model"),
        prompts=parse_prompts(f),
        options=parse_options(
            f, f.integer("max_tokens", 16, 1), f.integer("logprobs", None, 0, MAX_LOGPROBS)
        ),
        echo=f.boolean("echo", False),
        stream=stream,
        include_usage=include_usage,
        user=f.string("user"),
    )


def parse_tokenize(data: dict[str, Any]) -> TokenizeRequest:
    f = Fields(data)
    has_messages = f.raw("messages") is not None
    prompt = f.string("prompt")
    if prompt is None and not has_messages:
        raise InvalidRequest("give 'prompt' (a string) or 'messages'", "prompt")
    messages = parse_messages(f)[0] if has_messages else None
    add_special = f.boolean("add_special_tokens", not has_messages)
    return TokenizeRequest(f.string("model"), prompt, messages, add_special)


def parse_detokenize(data: dict[str, Any]) -> DetokenizeRequest:
    f = Fields(data)
    tokens = f.int_list("tokens")
    if tokens is None:
        raise InvalidRequest("'tokens' (an array of token ids) is required", "tokens")
    return DetokenizeRequest(f.string("model"), tokens)


def parse_options(f: Fields, max_tokens: int | None, logprobs: int | None) -> TextOptions:
    """The sampling and stopping options shared by chat and completions."""
    return TextOptions(
        max_tokens=max_tokens,
        temperature=_num(f, "temperature", 1.0, 0, 2),
        top_p=_num(f, "top_p", 1.0, 0, 1, lo_open=True),
        top_k=_int(f, "top_k", 0, -1, INT32_MAX),
        min_p=_num(f, "min_p", 0.0, 0, 1),
        seed=f.integer("seed", None),
        stop=_stop(f),
        stop_token_ids=tuple(f.int_list("stop_token_ids") or ()),
        presence_penalty=_num(f, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_num(f, "frequency_penalty", 0.0, -2, 2),
        repetition_penalty=_num(f, "repetition_penalty", 1.0, 0, 100, lo_open=True),
        logit_bias=_logit_bias(f),
        ignore_eos=f.boolean("ignore_eos", False),
        min_tokens=_int(f, "min_tokens", 0, 0, INT32_MAX),
        include_stop_str_in_output=f.boolean("include_stop_str_in_output", False),
        skip_special_tokens=f.boolean("skip_special_tokens", True),
        n=_int(f, "n", 1, 1, MAX_N),
        logprobs=logprobs,
        priority=_int(f, "priority", 0, -INT32_MAX - 1, INT32_MAX),
    )


def _num(
    f: Fields, name: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    value = f.number(name, default, lo, hi, lo_open)
    assert value is not None
    return value


def _int(f: Fields, name: str, default: int, lo: int, hi: int) -> int:
    value = f.integer(name, default, lo, hi)
    assert value is not None
    return value


def _stream_options(f: Fields) -> tuple[bool, bool]:
    stream = f.boolean("stream", False)
    options = f.obj("stream_options")
    include_usage = (
        Fields(options, "stream_options.").boolean("include_usage", False) if options else False
    )
    return stream, include_usage


def _stop(f: Fields) -> tuple[str, ...]:
    value = f.raw("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    items = f.array("stop", MAX_STOP)
    if items is None or not all(isinstance(s, str) for s in items):
        raise f.error("stop", "must be a string or an array of strings")
    return tuple(s for s in items if s)


def _logit_bias(f: Fields) -> dict[int, float]:
    raw = f.obj("logit_bias") or {}
    bias: dict[int, float] = {}
    for key in raw:
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise f.error("logit_bias", f"keys must be token ids (digit strings), got {key!r:.40}")
        number = Fields(raw, "logit_bias.").number(key, 0.0, -100, 100)
        bias[int(key)] = float(number or 0.0)
    return bias


def parse_messages(f: Fields) -> tuple[list[dict[str, Any]], bool]:
    """Chat messages with text parts joined; also whether any image part was given."""
    items = f.array("messages")
    if not items:
        raise f.error("messages", "must be a non-empty array" if items == [] else "is required")
    messages, has_images = [], False
    for i, item in enumerate(items):
        message, images = _parse_message(item, f"messages[{i}].")
        messages.append(message)
        has_images = has_images or images
    return messages, has_images


def _parse_message(item: Any, prefix: str) -> tuple[dict[str, Any], bool]:
    if not isinstance(item, dict):
        raise InvalidRequest(f"'{prefix[:-1]}' must be an object", prefix[:-1])
    f = Fields(item, prefix)
    role = f.string("role")
    if role not in ROLES:
        raise f.error("role", f"must be one of {', '.join(ROLES)}, got {role!r:.40}")
    content = f.raw("content")
    if content is None or isinstance(content, str):
        return {"role": role, "content": content or ""}, False
    parts = f.array("content")
    if parts is None:
        raise f.error("content", "must be a string or an array of content parts")
    text, images = _parse_parts(parts, prefix + "content")
    return {"role": role, "content": text}, images


def _parse_parts(parts: list[Any], prefix: str) -> tuple[str, bool]:
    texts, images = [], False
    for j, part in enumerate(parts):
        pf = Fields(part if isinstance(part, dict) else {}, f"{prefix}[{j}].")
        kind = pf.string("type")
        if kind == "text":
            text = pf.string("text")
            if text is None:
                raise pf.error("text", "is required in a text part")
            texts.append(text)
        elif kind == "image_url":
            image = pf.obj("image_url")
            if image is None or not isinstance(image.get("url"), str):
                raise pf.error("image_url", "must be an object with a 'url' string")
            images = True
        else:
            raise pf.error("type", f"must be 'text' or 'image_url', got {kind!r:.40}")
    return "".join(texts), images


def parse_prompts(f: Fields) -> list[str | list[int]]:
    """The completions prompt: a string, strings, token ids or lists of token ids."""
    value = f.raw("prompt")
    if isinstance(value, str):
        return [value]
    items = f.array("prompt")
    if not items:
        raise f.error("prompt", "is required" if items is None else "must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [_token_ids(f, items)]
    if len(items) > MAX_PROMPTS:
        raise f.error("prompt", f"may hold at most {MAX_PROMPTS} prompts, got {len(items)}")
    if all(isinstance(p, str) for p in items):
        return list(items)
    if all(isinstance(p, list) for p in items):
        return [_token_ids(f, p) for p in items]
    raise f.error("prompt", "must be a string, strings, token ids or lists of token ids")


def _token_ids(f: Fields, items: list[Any]) -> list[int]:
    ids = Fields({"prompt": items}).int_list("prompt")
    if not ids:
        raise f.error("prompt", "must not hold an empty token list")
    return ids
