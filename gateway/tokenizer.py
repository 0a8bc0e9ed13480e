"""The model's HF tokenizer with its chat template, usable from asyncio without stalls.

Free of HTTP concerns so the offline API can reuse it. Blocking methods do the
work inline; the `*_async` variants run it on a small thread pool so one long
prompt never stalls the event loop (the Rust tokenizer releases the GIL).

Text is checked before any tokenizer work (InvalidRequest): it must be valid
Unicode (no lone surrogates), and once `limit_tokens(max_model_len)` was called,
no longer than max_model_len tokens could possibly cover: max_model_len times the
longest vocabulary entry, in characters. So a prompt costs tokenizer time and
memory bounded by the context length, never by its size.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gateway.chat_format import ContentFormat, detect_content_format, shaped
from gateway.errors import InvalidRequest
from services.default_model import resolve_model

T = TypeVar("T")

# One chat turn as the template sees it: {"role": ..., "content": ...}.
ChatTurn = dict[str, Any]


class Tokenizer:
    """Encode, decode and render chats for one model directory."""

    def __init__(self, hf_tokenizer: Any, max_workers: int = 2) -> None:
        self.hf = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        # Every id decode(skip_special_tokens=True) drops: the named special tokens and any
        # added token flagged special (SmolLM2's <repo_name>, <file_sep>, ... are only these).
        added = getattr(hf_tokenizer, "added_tokens_decoder", {})
        self.special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids) | {
            i for i, token in added.items() if getattr(token, "special", False)
        }
        self.vocab_size: int = len(hf_tokenizer)
        # Most characters one token covers (a byte-level or sentencepiece symbol is never
        # shorter than the text it stands for).
        self.max_token_chars: int = max(map(len, hf_tokenizer.get_vocab()), default=1)
        self.max_text_chars: int | None = None  # set by limit_tokens()
        # How message content reaches the template: string or OpenAI-style parts.
        self.content_format: ContentFormat = detect_content_format(
            getattr(hf_tokenizer, "chat_template", None)
        )
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tokenize")

    @classmethod
    def load(
        cls,
        model: str | Path,
        max_workers: int = 2,
        chat_template: str = "",
        content_format: str = "auto",
    ) -> Tokenizer:
        """Load the tokenizer of `model` ("default", a served name or a directory);
        `chat_template`: a Jinja file that replaces the model's own template;
        `content_format`: how message content reaches it (gateway.chat_format)."""
        from transformers import AutoTokenizer

        path = resolve_model(str(model))
        hf = AutoTokenizer.from_pretrained(str(path))
        if chat_template:
            hf.chat_template = Path(chat_template).expanduser().read_text(encoding="utf-8")
        tokenizer = cls(hf, max_workers)
        tokenizer.content_format = detect_content_format(hf.chat_template, content_format)
        return tokenizer

    def close(self) -> None:
        """Stop the thread pool (pending work finishes first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def limit_tokens(self, max_model_len: int) -> None:
        """Refuse, before tokenizing, text too long to fit in `max_model_len` tokens."""
        self.max_text_chars = max_model_len * self.max_token_chars

    def check_text(self, text: str, what: str = "the prompt") -> None:
        """InvalidRequest unless `text` is valid Unicode and within `max_text_chars`."""
        self._check_length(len(text), what)
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequest(
                    f"{what} is not valid Unicode: a lone surrogate "
                    f"(U+{ord(text[exc.start]):04X}) at character {exc.start}"
                ) from None

    def _check_length(self, num_chars: int, what: str) -> None:
        limit = self.max_text_chars
        if limit is not None and num_chars > limit:
            raise InvalidRequest(
                f"{what} is {num_chars} characters; no text over {limit} characters fits "
                f"the context length ({limit // self.max_token_chars} tokens)"
            )

    # -- blocking API ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (checked first, see `check_text`)."""
        self.check_text(text)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: Sequence[ChatTurn],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat rendered by the model's template, as text (`template_kwargs`: the
        request's chat_template_kwargs, extra variables of the template)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        self._check_messages(messages)
        text = self.hf.apply_chat_template(
            shaped(messages, self.content_format),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
        return str(text)

    def _check_messages(self, messages: Sequence[ChatTurn]) -> None:
        """`check_text` on each message's text and on their total length."""
        texts = [t for m in messages for t in _texts(m.get("content"))]
        self._check_length(sum(map(len, texts)), "the conversation")
        for text in texts:
            self.check_text(text, "a message")

    def encode_chat(
        self, messages: Sequence[ChatTurn], add_generation_prompt: bool = True, **render: Any
    ) -> list[int]:
        """Token ids of the rendered chat (the template already holds any BOS); `render`:
        render_chat's keyword arguments."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **render), False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` in one shot."""
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of `token_ids` (byte-level symbols, not text)."""
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(token_ids))]

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (may hold U+FFFD for a partial character)."""
        return str(self.hf.decode([token_id], skip_special_tokens=False))

    def is_valid_id(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size

    # -- asyncio API -------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the tokenizer pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(self.encode, text, add_special_tokens)

    async def encode_chat_async(self, messages: Sequence[ChatTurn], **render: Any) -> list[int]:
        return await self.run(functools.partial(self.encode_chat, messages, **render))

    async def decode_async(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return await self.run(self.decode, token_ids, skip_special_tokens)


def _texts(content: Any) -> list[str]:
    """The text of a message's content: a string, or the text parts of a list."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
    return []
