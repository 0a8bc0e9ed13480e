"""The official `openai` client against the live gateway and the fake EngineCore over gRPC."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.conftest import ANSWER, API_KEY, Stack
from tests.gateway.fake_engine import MODEL_NAME, FakeEngine, cached_tokens, fake_logprob

pytestmark = pytest.mark.slow
MESSAGES: Any = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def stack(stack_dp: Stack) -> Stack:
    """This suite runs against one engine replica and against two (data parallel)."""
    return stack_dp


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, max_retries=0)


def answer_tokens(tokenizer: Tokenizer) -> int:
    return len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 1  # + EOS


def test_models_lists_the_scheduler_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_chat_non_streaming(
    client: openai.OpenAI, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=1234)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == MODEL_NAME
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == ANSWER
    assert choice.finish_reason == "stop"
    (request,) = engine.requests
    assert request.sampling_params.seed == 1234  # seed passthrough
    prompt = tokenizer.encode_chat(MESSAGES)
    assert request.prompt_token_ids == prompt
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == answer_tokens(tokenizer)
    assert reply.usage.total_tokens == len(prompt) + answer_tokens(tokenizer)
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == cached_tokens(len(prompt))
    # no max_tokens: the rest of the context (vLLM behaviour)
    assert request.sampling_params.max_tokens == 512 - len(prompt)


def test_chat_streaming_with_usage(
    client: openai.OpenAI, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == answer_tokens(tokenizer)
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_chat_n3_fans_out_into_three_engine_requests(
    client: openai.OpenAI, engine: FakeEngine
) -> None:
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=3, max_tokens=5)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in reply.choices)
    ids = sorted(r.request_id for r in engine.requests)
    assert len(ids) == 3 and [i.rsplit("-", 1)[1] for i in ids] == ["0", "1", "2"]
    assert len({i.rsplit("-", 1)[0] for i in ids}) == 1
    assert reply.usage is not None and reply.usage.completion_tokens == 15


def test_chat_n3_streaming(client: openai.OpenAI, engine: FakeEngine) -> None:
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=3, stream=True)
    texts = {0: "", 1: "", 2: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: ANSWER, 1: ANSWER, 2: ANSWER}


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens(
    client: openai.OpenAI, engine: FakeEngine, tokenizer: Tokenizer, stream: bool
) -> None:
    stop = "e END o"  # spans " The", " END", " of": never one token
    assert not any(stop in tokenizer.token_text(t) for t in engine.answer_ids)
    engine.token_delay_s = 0.02  # still streaming when the stop string is found
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "stop": [stop, "zzz"]}
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert text == ANSWER[: ANSWER.index(stop)] and finish == "stop"
    (request_id,) = [r.request_id for r in engine.requests]
    assert wait_for(lambda: request_id in engine.cancelled_at)  # the match ended the engine request


def test_include_stop_str_in_output(client: openai.OpenAI, engine: FakeEngine) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        stop="END",
        extra_body={"include_stop_str_in_output": True},
    )
    assert reply.choices[0].message.content == ANSWER[: ANSWER.index("END") + 3]


def test_chat_logprobs(client: openai.OpenAI, engine: FakeEngine, tokenizer: Tokenizer) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        logprobs=True,
        top_logprobs=2,
        max_tokens=4,
    )
    assert engine.requests[0].sampling_params.logprobs == 2
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for i, entry in enumerate(content):
        assert entry.token == tokenizer.token_text(engine.answer_ids[i])
        assert math.isclose(entry.logprob, fake_logprob(i))
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())


def test_completion_non_streaming_with_logprobs(client: openai.OpenAI, engine: FakeEngine) -> None:
    reply = client.completions.create(
        model=MODEL_NAME, prompt="Once upon", max_tokens=3, logprobs=1
    )
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert [round(x, 2) for x in choice.logprobs.token_logprobs] == [-0.25, -0.5, -0.75]
    assert "".join(choice.logprobs.tokens or []) == choice.text


def test_completion_echo_with_prompt_logprobs(
    client: openai.OpenAI, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    prompt = "The quick brown fox"
    reply = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=2, echo=True, logprobs=0
    )
    choice = reply.choices[0]
    assert choice.text.startswith(prompt) and choice.text == prompt + tokenizer.decode(
        engine.answer_ids[:2]
    )
    assert engine.requests[0].sampling_params.prompt_logprobs == 0
    lps = choice.logprobs.token_logprobs  # type: ignore[union-attr]
    n_prompt = len(tokenizer.encode(prompt))
    assert lps is not None and len(lps) == n_prompt + 2 and lps[0] is None and lps[1] == -1.0


def test_completion_streaming_multiple_prompts(client: openai.OpenAI, engine: FakeEngine) -> None:
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=["a", "b"],
        max_tokens=2,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert sorted(texts) == [0, 1, 2, 3] and len(set(texts.values())) == 1
    assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens == 2


def test_completion_token_id_prompts(client: openai.OpenAI, engine: FakeEngine) -> None:
    reply = client.completions.create(model=MODEL_NAME, prompt=[[1, 2, 3], [4, 5]], max_tokens=1)
    assert len(reply.choices) == 2
    assert sorted(r.prompt_token_ids for r in engine.requests) == [[1, 2, 3], [4, 5]]


def test_sampling_parameters_pass_through(client: openai.OpenAI, engine: FakeEngine) -> None:
    client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0.5, top_p=0.9, max_completion_tokens=7,
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"42": 3}, stop=None,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True,
                    "stop_token_ids": [7], "priority": -3},
    )  # fmt: skip
    (request,) = engine.requests
    p = request.sampling_params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (
        0.5,
        pytest.approx(0.9),
        5,
        7,
        2,
    )
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.repetition_penalty == pytest.approx(1.2) and p.min_p == pytest.approx(0.1)
    assert p.logit_bias == {42: 3.0} and p.stop_token_ids == (7,) and p.ignore_eos
    assert request.priority == -3


def wait_for(predicate: object, timeout_s: float = 2.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_completion_stream_with_echo_and_logprobs(
    client: openai.OpenAI, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    prompt = "Echo this"
    stream = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=1, stream=True
    )
    text, tokens = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens if c.logprobs and c.logprobs.tokens else []
    assert text == prompt + tokenizer.decode(engine.answer_ids[:3])
    assert len(tokens) == len(tokenizer.encode(prompt)) + 3
