"""`--reasoning-parser`: recorded model texts split into `reasoning_content` and `content` as
vLLM's qwen3 / deepseek_r1 parsers define it, whole and streamed in any chunking, and read
by the official openai client through the live gateway (the fake engine answers the text)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.reasoning import ReasoningParser, ReasoningStream
from gateway.tokenizer import Tokenizer
from tests.gateway.conftest import Stack, start_stack

# (parser, thinking on, model text, reasoning_content, content)
CASES: list[tuple[str, bool, str, str | None, str | None]] = [
    # Qwen3 writes the whole block itself.
    ("qwen3", True, "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n",
     "\n\nHello!"),
    # Templates that open the block in the prompt: only the end tag is generated.
    ("qwen3", True, "Short thought.</think>Answer.", "Short thought.", "Answer."),
    # Cut short inside the thinking: all of it is reasoning.
    ("qwen3", True, "<think>Still thinking about", "Still thinking about", None),
    # enable_thinking=false: no block, all content.
    ("qwen3", False, "Paris is the capital.", None, "Paris is the capital."),
    ("qwen3", True, "<think>x</think>", "x", None),
    # DeepSeek-R1: the template opens the block; the model writes only the end tag.
    ("deepseek_r1", True, "Let me add 2 and 2.\n</think>\n\n4", "Let me add 2 and 2.\n", "\n\n4"),
    ("deepseek_r1", True, "<think>Step one.</think>Done.", "Step one.", "Done."),
    ("deepseek_r1", True, "no end tag at all", "no end tag at all", None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "thinking", "text", "reasoning", "content"), CASES)
def test_whole_outputs_split_like_vllm(
    name: str, thinking: bool, text: str, reasoning: str | None, content: str | None
) -> None:
    assert ReasoningParser(name, thinking).split(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "thinking", "text", "reasoning", "content"), CASES)
def test_every_chunking_streams_the_same_split(
    name: str, thinking: bool, text: str, reasoning: str | None, content: str | None
) -> None:
    rng = random.Random(0)
    for trial in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(trial % 6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ReasoningStream(ReasoningParser(name, thinking))
        got = [stream.feed(p) for p in pieces] + [stream.finish()]
        assert "".join(r for r, _ in got) == (reasoning or ""), pieces
        assert "".join(c for _, c in got) == (content or ""), pieces


def test_enable_thinking_false_comes_from_the_request() -> None:
    assert not ReasoningParser.for_request("qwen3", {"enable_thinking": False}).thinking
    assert ReasoningParser.for_request("qwen3", None).thinking
    assert ReasoningParser.for_request("deepseek_r1", {"enable_thinking": False}).thinking


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer) -> Iterator[Stack]:
    s = start_stack(tokenizer, reasoning_parser="qwen3")
    yield s
    s.stop()


@pytest.fixture
def client(stack: Stack, tokenizer: Tokenizer) -> Iterator[Any]:
    saved = stack.engine.answer_ids
    yield openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    stack.engine.answer_ids = saved


def _answer(stack: Stack, tokenizer: Tokenizer, text: str) -> None:
    stack.engine.answer_ids = tokenizer.encode(text, add_special_tokens=False)


ASK: Any = [{"role": "user", "content": "Hi"}]


def test_the_openai_client_reads_reasoning_content(
    stack: Stack, client: Any, tokenizer: Tokenizer
) -> None:
    _answer(stack, tokenizer, "<think>\nThe user greets me.\n</think>\n\nHello!")
    reply = client.chat.completions.create(model="fake-smollm", messages=ASK)
    message = reply.choices[0].message
    assert message.reasoning_content == "\nThe user greets me.\n"
    assert message.content == "\n\nHello!"
    stream = client.chat.completions.create(model="fake-smollm", messages=ASK, stream=True)
    thought, said = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            said += choice.delta.content or ""
    assert (thought, said) == (message.reasoning_content, message.content)


def test_thinking_turned_off_is_all_content(
    stack: Stack, client: Any, tokenizer: Tokenizer
) -> None:
    _answer(stack, tokenizer, "Paris is the capital.")
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = client.chat.completions.create(model="fake-smollm", messages=ASK, extra_body=kwargs)
    assert reply.choices[0].message.content == "Paris is the capital."
    assert reply.choices[0].message.reasoning_content is None
    turned_on = client.chat.completions.create(model="fake-smollm", messages=ASK)
    assert turned_on.choices[0].message.reasoning_content == "Paris is the capital."


def test_tool_calls_are_parsed_after_the_thinking(
    stack: Stack, client: Any, tokenizer: Tokenizer
) -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    _answer(stack, tokenizer, f"I need the time.</think>{call}")
    tools: Any = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    reply = client.chat.completions.create(model="fake-smollm", messages=ASK, tools=tools)
    choice = reply.choices[0]
    assert choice.message.reasoning_content == "I need the time."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert choice.finish_reason == "tool_calls"
