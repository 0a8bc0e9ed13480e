"""`--chat-template FILE` replaces the model's template, and a request's
`chat_template_kwargs` (vLLM's field) reach it as template variables; the arguments the
server sets itself cannot be overridden (400 in OpenAI's shape)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.conftest import Stack, start_stack

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if mood %}({{ mood }}){% endif %}{% endif %}"
)
ASK: Any = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    tok = Tokenizer.load(tokenizer.hf.name_or_path, chat_template=str(path))
    s = start_stack(tok)
    yield s
    s.stop()


@pytest.fixture
def client(stack: Stack) -> Any:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def _last_prompt(stack: Stack, tokenizer: Tokenizer) -> str:
    return tokenizer.decode(stack.engine.requests[-1].prompt_token_ids, False)


def test_the_file_template_renders_the_chat(
    stack: Stack, client: Any, tokenizer: Tokenizer
) -> None:
    client.chat.completions.create(model="fake-smollm", messages=ASK, max_tokens=2)
    assert _last_prompt(stack, tokenizer) == "<user>Hi<assistant>"


def test_chat_template_kwargs_are_template_variables(
    stack: Stack, client: Any, tokenizer: Tokenizer
) -> None:
    client.chat.completions.create(
        model="fake-smollm", messages=ASK, max_tokens=2,
        extra_body={"chat_template_kwargs": {"mood": "cheerful"}},
    )  # fmt: skip
    assert _last_prompt(stack, tokenizer) == "<user>Hi<assistant>(cheerful)"


@pytest.mark.parametrize("key", ["add_generation_prompt", "tokenize", "messages", "tools"])
def test_server_set_arguments_are_refused(client: Any, key: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="fake-smollm", messages=ASK, extra_body={"chat_template_kwargs": {key: 1}}
        )
    assert key in info.value.message
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def test_the_file_is_read_when_the_tokenizer_loads(tmp_path: Path, tokenizer: Tokenizer) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tokenizer.hf.name_or_path, chat_template=str(tmp_path / "missing.jinja"))
