"""Incremental detokenization that is correct for byte-level BPE and multi-byte UTF-8.

vLLM's prefix/read offset scheme: decode a small window of ids twice, with and
without the newest ones, and emit the difference only when it does not end in
U+FFFD (a character whose bytes are split across tokens is held until whole).
Concatenating every delta and `flush()` gives the same text as decoding all
ids at once. Free of HTTP concerns so the offline API can reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt ids kept as left context, so tokenizers that drop a leading space
# (SentencePiece) detokenize the first output token like the one-shot decode of the whole.
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of `gateway.tokenizer.Tokenizer` the detokenizer needs."""

    special_ids: frozenset[int]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turn a stream of token ids into a stream of text deltas for one sequence."""

    def __init__(
        self,
        tokenizer: Decoder,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = [t for t in context_ids[-CONTEXT_TOKENS:] if self._keep(t)]
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # ids before this are already emitted as text
        self.text = ""  # everything emitted so far

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add ids and return the newly complete text ("" while a character is split)."""
        self._ids.extend(t for t in new_token_ids if self._keep(t))
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(full_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held, even a partial character."""
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        return self._advance(full_text[len(prefix_text) :])

    def _advance(self, delta: str) -> str:
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[: self._prefix]  # keep the window small
        self._read -= self._prefix
        self._prefix = 0
        self.text += delta
        return delta

    def _keep(self, token_id: int) -> bool:
        return not (self._skip and token_id in self._tokenizer.special_ids)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=False)
