"""Incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest

from gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from gateway.tokenizer import Tokenizer

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 plus flags 🇫🇷🇯🇵.",
    "CJK: 日本語のテキスト、中文文本，한국어 텍스트。",  # noqa: RUF001
    "Accents: café, naïve, façade, Ærøskøbing, crème brûlée, São Paulo, Łódź.",
    "Mixed 😀日本é\n\ttabs and  double  spaces ✓ ∑ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # noqa: RUF001
]


def stream_deltas(tok: Tokenizer, ids: list[int], step: int, **kwargs: object) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)  # type: ignore[arg-type]
    deltas = [detok.update(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*deltas, detok.flush()]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_stream_deltas_equal_one_shot_decode(tokenizer: Tokenizer, text: str, step: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream_deltas(tokenizer, ids, step)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas


@pytest.mark.slow
def test_split_characters_are_held_until_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes span tokens: the interesting case
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.update([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.update(ids[-1:]) == " 😀"


@pytest.mark.slow
def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), 2]  # 2 = <|im_end|>
    assert "".join(stream_deltas(tokenizer, ids, 1)) == "Hi"
    kept = "".join(stream_deltas(tokenizer, ids, 1, skip_special_tokens=False))
    assert kept == "Hi<|im_end|>"


@pytest.mark.slow
def test_prompt_context_does_not_leak_into_output(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Question: 日本", add_special_tokens=False)
    out = tokenizer.encode(" answer é", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, context_ids=prompt)
    text = "".join(detok.update([t]) for t in out) + detok.flush()
    assert text == " answer é" == detok.text


@pytest.mark.slow
def test_truncated_character_is_flushed_at_the_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" 😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(ids) == ""
    assert detok.flush() == tokenizer.decode(ids)  # the partial bytes, as the one-shot decode
