"""The prompt forms `LLM.generate` accepts, as vLLM's offline API does.

A prompt is text (`str`), token ids (`list[int]`), `{"prompt": str}` (TextPrompt) or
`{"prompt_token_ids": list[int]}` (TokensPrompt); `generate` takes one or a list. A
TextPrompt may carry `"multi_modal_data": {"image": PIL.Image | list[PIL.Image]}`. Every
prompt is checked before anything is queued, and a bad one is named by its index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any, TypedDict


class TextPrompt(TypedDict, total=False):
    """A text prompt, tokenized with the model's tokenizer (images: a VLM's processor)."""

    prompt: str
    multi_modal_data: dict[str, Any]


class TokensPrompt(TypedDict):
    """A prompt given as token ids."""

    prompt_token_ids: list[int]


Prompt = str | Sequence[int] | TextPrompt | TokensPrompt

_FORMS = "a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': [int, ...]}"


@dataclass(frozen=True)
class ParsedPrompt:
    """A prompt as the engine takes it, and its text where it came as text."""

    token_ids: list[int]
    text: str | None
    images: tuple[Any, ...] = ()  # PIL images of a multi_modal_data prompt (ids left empty)


def as_batch(prompts: Any) -> list[Any]:
    """One prompt (text, one id list, one dict) becomes a batch of one; a list stays a list."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a prompt or a list of prompts ({_FORMS}), not {_kind(prompts)}"
        )
    if prompts and _is_token_id(prompts[0]):
        return [prompts]
    return list(prompts)


def parse_prompts(prompts: Any, encode: Callable[[str], list[int]]) -> list[ParsedPrompt]:
    """Every prompt of `prompts` checked and tokenized; TypeError/ValueError name the index."""
    batch = as_batch(prompts)
    if not batch:
        raise ValueError("no prompts given")
    return [_parse(p, i, encode) for i, p in enumerate(batch)]


def _parse(prompt: Any, index: int, encode: Callable[[str], list[int]]) -> ParsedPrompt:
    if isinstance(prompt, Mapping) and "multi_modal_data" in prompt:
        return _multimodal(prompt, index)
    if isinstance(prompt, Mapping):
        prompt = _unwrap(prompt, index)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {index} is empty")
        return ParsedPrompt(encode(prompt), prompt)
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        return ParsedPrompt(_token_ids(prompt, index), None)
    raise TypeError(f"prompt {index} must be {_FORMS}, not {_kind(prompt)}")


def _multimodal(prompt: Mapping[Any, Any], index: int) -> ParsedPrompt:
    """{"prompt": str, "multi_modal_data": {"image": image or [images]}}: text and images."""
    text, data = prompt.get("prompt"), prompt["multi_modal_data"]
    if set(prompt) != {"prompt", "multi_modal_data"} or not isinstance(text, str) or not text:
        raise ValueError(f"prompt {index}: multi_modal_data needs a non-empty 'prompt' str")
    if not isinstance(data, Mapping) or set(data) != {"image"}:
        raise ValueError(f"prompt {index}: multi_modal_data must be {{'image': ...}}")
    images = data["image"]
    images = tuple(images) if isinstance(images, list | tuple) else (images,)
    return ParsedPrompt([], text, images)


def _unwrap(prompt: Mapping[Any, Any], index: int) -> Any:
    """The text or token ids inside a TextPrompt / TokensPrompt dict."""
    keys = set(prompt)
    if keys == {"prompt"}:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(
                f"prompt {index}: 'prompt' must be a str, not {_kind(prompt['prompt'])}"
            )
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise TypeError(
                f"prompt {index}: 'prompt_token_ids' must be a list of int, not {_kind(ids)}"
            )
        return ids
    raise ValueError(
        f"prompt {index}: a dict prompt has exactly one of the keys 'prompt' or "
        f"'prompt_token_ids', not {sorted(map(str, keys))}"
    )


def _token_ids(ids: Sequence[Any], index: int) -> list[int]:
    if not ids:
        raise ValueError(f"prompt {index} has no token ids")
    bad = next((t for t in ids if not _is_token_id(t)), None)
    if bad is not None:
        raise TypeError(f"prompt {index}: token ids must be integers, found {_kind(bad)} {bad!r}")
    return [int(t) for t in ids]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return type(value).__name__
