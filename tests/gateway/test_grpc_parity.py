"""The gRPC TextGeneration fields REST has too: each one's mapping to the engine request,
the answer fields built from it, and the status of a bad value (the fake engine behind
the real gateway)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gateway.tokenizer import Tokenizer
from services.config import SecurityConfig
from services.grpc_utils import sync_channel
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from tests.gateway.conftest import ANSWER, API_KEY, Stack
from tests.gateway.fake_engine import EOS, FakeEngine, fake_logprob

pytestmark = pytest.mark.slow
HELLO = [pb.ChatMessage(role="user", content="Say hello.")]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = pb.Tool(name="get_weather", description="The weather.", parameters=json.dumps(SCHEMA))
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def stub(stack: Stack) -> Iterator[pb_grpc.TextGenerationStub]:
    with sync_channel(stack.grpc_address, security=SecurityConfig(token=API_KEY)) as channel:
        yield pb_grpc.TextGenerationStub(channel)


@pytest.fixture
def answer(engine: FakeEngine, tokenizer: Tokenizer) -> Iterator[Any]:
    """Set what the fake engine answers (restored afterwards)."""
    saved = engine.answer_ids

    def set_answer(text: str) -> None:
        engine.answer_ids = tokenizer.encode(text, add_special_tokens=False)

    yield set_answer
    engine.answer_ids = saved


def chat(**params: Any) -> pb.ChatRequest:
    return pb.ChatRequest(messages=HELLO, params=pb.TextSamplingParams(**params))


def test_sampling_fields_reach_the_engine(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine
) -> None:
    params = pb.TextSamplingParams(
        n=2, seed=7, stop_token_ids=[5, 6], logit_bias={11: -100.0, 12: 2.5},
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=2,
        ignore_eos=True, max_tokens=4, skip_special_tokens=False,
    )  # fmt: skip
    reply = stub.Chat(pb.ChatRequest(messages=HELLO, params=params))
    assert [c.index for c in reply.choices] == [0, 1]
    assert len(engine.requests) == 2
    assert sorted(r.sampling_params.seed or 0 for r in engine.requests) == [7, 8]  # seed + j
    for request in engine.requests:
        sp = request.sampling_params
        assert (tuple(sp.stop_token_ids), sp.logit_bias) == ((5, 6), {11: -100, 12: 2.5})
        penalties = (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
        assert penalties == (0.5, -0.5, 1.2)
        assert (sp.min_tokens, sp.ignore_eos, sp.max_tokens) == (2, True, 4)
    assert reply.usage.completion_tokens == 8 and reply.finish_reason == "length"


def test_stop_token_id_ends_the_answer_with_its_reason(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine
) -> None:
    third = engine.answer_ids[2]
    reply = stub.Complete(
        pb.CompletionRequest(prompt="Once", params=pb.TextSamplingParams(stop_token_ids=[third]))
    )
    (choice,) = reply.choices
    assert choice.finish_reason == "stop" and choice.stop_token_id == third
    assert reply.usage.completion_tokens == 3
    eos = stub.Complete(pb.CompletionRequest(prompt="Once")).choices[0]
    assert eos.WhichOneof("stop_reason") == "stop_token_id" and eos.stop_token_id == EOS
    stopped = stub.Chat(chat(stop=["naïve"])).choices[0]
    assert stopped.stop_string == "naïve" and stopped.text == ANSWER[: ANSWER.index("naïve")]


def test_logprobs_carry_token_text_id_and_bytes(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine, tokenizer: Tokenizer
) -> None:
    reply = stub.Chat(chat(logprobs=True, top_logprobs=2))
    (choice,) = reply.choices
    ids = [*engine.answer_ids, EOS]
    assert [e.token_id for e in choice.logprobs] == ids
    for i, entry in enumerate(choice.logprobs):
        assert entry.logprob == pytest.approx(fake_logprob(i))
        assert entry.token == tokenizer.token_text(ids[i])
        assert entry.bytes == entry.token.encode()
        assert [t.token_id for t in entry.top_logprobs] == [ids[i], 100]
    assert engine.requests[0].sampling_params.logprobs == 2
    plain = stub.Complete(
        pb.CompletionRequest(prompt="Once", params=pb.TextSamplingParams(logprobs=True))
    )
    assert len(plain.choices[0].logprobs) == len(ids)
    assert not plain.choices[0].logprobs[0].top_logprobs
    assert not stub.Chat(chat()).choices[0].logprobs  # none unless asked


def test_stream_names_each_choice_and_ends_with_usage(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine
) -> None:
    chunks = list(stub.ChatStream(chat(n=2, logprobs=True)))
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert "".join(c.text for c in mine) == ANSWER
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]
        assert sum(len(c.logprobs) for c in mine) == len(engine.answer_ids) + 1
    assert [c.HasField("usage") for c in chunks].count(True) == 1 and chunks[-1].HasField("usage")
    assert chunks[-1].usage.completion_tokens == 2 * (len(engine.answer_ids) + 1)
    completion = list(
        stub.CompleteStream(pb.CompletionRequest(prompt="Once", params=chat(n=2).params))
    )
    assert {c.index for c in completion} == {0, 1} and completion[-1].HasField("usage")


@pytest.mark.parametrize(
    ("constraint", "field", "value"),
    [
        (pb.StructuredOutputs(json=json.dumps(SCHEMA)), "json", json.dumps(SCHEMA)),
        (pb.StructuredOutputs(regex="[a-z]+"), "regex", "[a-z]+"),
        (pb.StructuredOutputs(choice=pb.StringChoices(values=["yes", "no"])), "choice", ("yes", "no")),
        (pb.StructuredOutputs(grammar='start: "a"+'), "grammar", 'start: "a"+'),
        (pb.StructuredOutputs(json_object=True), "json_object", True),
    ],
)  # fmt: skip
def test_structured_outputs_reach_the_engine(
    stub: pb_grpc.TextGenerationStub,
    engine: FakeEngine,
    constraint: pb.StructuredOutputs,
    field: str,
    value: Any,
) -> None:
    stub.Chat(chat(structured_outputs=constraint))
    (request,) = engine.requests
    assert getattr(request.sampling_params.structured_output, field) == value


def test_auto_tool_call_is_parsed(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine, answer: Any
) -> None:
    answer("Let me look." + HERMES)
    request = pb.ChatRequest(messages=HELLO, tools=[WEATHER])
    (choice,) = stub.Chat(request).choices
    assert choice.finish_reason == "tool_calls" and choice.text == "Let me look."
    (call,) = choice.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    chunks = list(stub.ChatStream(request))
    assert "".join(c.text for c in chunks) == "Let me look."
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris"}
    assert chunks[-1].finish_reason == "tool_calls"


def test_named_tool_choice_forces_the_schema(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine, answer: Any
) -> None:
    answer('{"city": "Paris"}')
    request = pb.ChatRequest(
        messages=HELLO, tools=[WEATHER], tool_choice=pb.ToolChoice(function="get_weather")
    )
    (choice,) = stub.Chat(request).choices
    (call,) = choice.tool_calls
    assert (call.name, call.arguments, choice.finish_reason) == (
        "get_weather", '{"city": "Paris"}', "tool_calls",
    )  # fmt: skip
    forced = engine.requests[0].sampling_params.structured_output
    assert forced is not None and json.loads(forced.json or "") == SCHEMA
    engine.requests.clear()
    none = stub.Chat(
        pb.ChatRequest(messages=HELLO, tools=[WEATHER], tool_choice=pb.ToolChoice(mode="none"))
    )
    assert (
        not none.choices[0].tool_calls
        and engine.requests[0].sampling_params.structured_output is None
    )


def test_tool_turns_of_earlier_calls_are_accepted(stub: pb_grpc.TextGenerationStub) -> None:
    history = [
        *HELLO,
        pb.ChatMessage(
            role="assistant",
            tool_calls=[
                pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
            ],
        ),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    ]
    assert stub.Chat(pb.ChatRequest(messages=history, tools=[WEATHER])).text == ANSWER


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (chat(top_logprobs=2), "'top_logprobs' requires 'logprobs'"),
        (chat(n=10**4), "n"),
        (chat(logit_bias={10**7: 1.0}), "logit_bias"),
        (chat(logit_bias={5: 1000.0}), "logit_bias"),
        (chat(stop_token_ids=[10**7]), "stop_token_ids"),
        (chat(structured_outputs=pb.StructuredOutputs(json="{not json")), "structured_outputs"),
        (chat(structured_outputs=pb.StructuredOutputs(regex="(")), "structured_outputs"),
        (chat(structured_outputs=pb.StructuredOutputs()), "structured_outputs"),
        (chat(min_tokens=9, max_tokens=3), "min_tokens"),
        (pb.ChatRequest(messages=HELLO, tools=[pb.Tool(name="f", parameters="{oops")]), "tools[0].parameters"),
        (pb.ChatRequest(messages=HELLO, tools=[pb.Tool(name="bad name!")]), "tools"),
        (pb.ChatRequest(messages=HELLO, tools=[WEATHER], tool_choice=pb.ToolChoice(function="nope")), "tool_choice"),
        (pb.ChatRequest(messages=HELLO, tool_choice=pb.ToolChoice(mode="required")), "'tool_choice' requires 'tools'"),
        (pb.ChatRequest(messages=HELLO, tools=[WEATHER], tool_choice=pb.ToolChoice(mode="always")), "tool_choice"),
        (pb.ChatRequest(messages=[pb.ChatMessage(role="user", parts=[pb.ContentPart(image=pb.Image(url="data:image/png;base64,AA=="))])]), "text-only"),
    ],
)  # fmt: skip
def test_bad_values_are_invalid_argument(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine, request_: pb.ChatRequest, words: str
) -> None:
    for call in (stub.Chat, lambda r: list(stub.ChatStream(r))):
        with pytest.raises(grpc.RpcError) as info:
            call(request_)
        assert info.value.code() == INVALID, info.value.details()
        assert words in (info.value.details() or ""), info.value.details()
    assert engine.requests == []


def test_completion_errors_are_invalid_argument(
    stub: pb_grpc.TextGenerationStub, engine: FakeEngine
) -> None:
    for params in (
        pb.TextSamplingParams(top_logprobs=1),
        pb.TextSamplingParams(logprobs=True, top_logprobs=10**3),
        pb.TextSamplingParams(n=0),
    ):
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(pb.CompletionRequest(prompt="Once", params=params))
        assert info.value.code() == INVALID, info.value.details()
    assert engine.requests == []


def test_every_public_field_has_a_doc_comment() -> None:
    """Each message, oneof, field and rpc of generate.proto has a `//` line right above it."""
    from benchmarks.stack import REPO

    lines = (REPO / "protos" / "generate.proto").read_text().splitlines()
    declaration = re.compile(
        r"^\s*(message|oneof|rpc|service|(optional |repeated )?[\w.<>, ]+ \w+ = \d+;)"
    )
    undocumented = [
        line.strip()
        for above, line in itertools.pairwise(lines)
        if declaration.match(line) and not above.strip().startswith("//")
    ]
    assert undocumented == []
