"""The gateway tokenizer: chat template, and tokenization off the event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.errors import InvalidRequest
from gateway.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


def test_chat_template_is_chatml(tokenizer: Tokenizer) -> None:
    text = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode_chat([{"role": "user", "content": "hi"}]) == tokenizer.encode(
        text, False
    )


def test_long_prompt_does_not_stall_the_event_loop(tokenizer: Tokenizer) -> None:
    tokenizer = Tokenizer(tokenizer.hf)  # no length limit (a gateway sets one on the shared one)
    text = "Hello wörld, 日本語 text 😀. " * 15_000  # ~400 kB
    started = time.perf_counter()
    expected = tokenizer.encode(text)
    inline_s = time.perf_counter() - started

    async def measure() -> tuple[list[int], float]:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        ids = await tokenizer.encode_async(text)
        ticker.cancel()
        return ids, max(gaps)

    ids, worst_gap = asyncio.run(measure())
    assert ids == expected
    assert worst_gap < inline_s / 2, (worst_gap, inline_s)  # the loop kept ticking meanwhile


def test_text_is_checked_before_tokenizing(tokenizer: Tokenizer) -> None:
    tok = Tokenizer(tokenizer.hf)
    tok.limit_tokens(100)
    assert tok.max_text_chars == 100 * tok.max_token_chars
    ok = "a" * tok.max_text_chars
    assert len(tok.encode(ok, add_special_tokens=False)) <= 100 * tok.max_token_chars
    with pytest.raises(InvalidRequest, match="characters"):
        tok.encode(ok + "a")
    with pytest.raises(InvalidRequest, match="characters"):
        tok.render_chat([{"role": "user", "content": ok}, {"role": "user", "content": "a"}])
    with pytest.raises(InvalidRequest, match=r"lone surrogate \(U\+D800\) at character 3"):
        tok.encode("abc\ud800")
    assert tok.encode("héllo") == tokenizer.encode("héllo")
