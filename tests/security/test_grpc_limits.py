"""Size limits refused before the work (issue 25, finding 5), and error texts that leak nothing.

Oversized repeated fields on the public gRPC API (500k turns, 200k image parts, 1M Tokenize
turns, 17 stop strings, a 5 KB stop string, 16M empty turns) are counted on the wire and
refused with INVALID_ARGUMENT before protobuf parses them: the call takes well under 100 ms on loopback
(asserted < 1 s, for a loaded machine). REST says the same limits in the same words. Error
messages carry no object reprs with addresses.
"""

from __future__ import annotations

import base64
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from benchmarks.tiny_vlm import build_tiny_llava, png_bytes, sample_image
from gateway.errors import InvalidRequest
from gateway.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP, MAX_STOP_CHARS
from gateway.tokenizer import Tokenizer
from services.grpc_interceptors import redact_addresses
from services.pb import generate_pb2 as pb
from tests.gateway.conftest import API_KEY, Stack, start_stack, tokenizer  # noqa: F401
from tests.gateway.fake_engine import MODEL_NAME

pytestmark = pytest.mark.slow
SERVICE = "/tessera.v1.TextGeneration/"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
STREAMING = {"CompleteStream", "ChatStream"}
RUNS = 5  # timed calls per case; the median is compared
HI = pb.ChatMessage(role="user", content="hi")
IMAGE_PART = pb.ContentPart(image=pb.Image(data=b"x", mime_type="image/png"))


def _chat(n: int = 1, **params: Any) -> pb.ChatRequest:
    return pb.ChatRequest(messages=[HI] * n, params=pb.TextSamplingParams(**params))


OVERSIZED: list[tuple[str, str, Callable[[], Any], str]] = [
    ("chat-500k-turns", "Chat", lambda: _chat(500_000), "may hold at most 10000 messages"),
    ("chatstream-500k-turns", "ChatStream", lambda: _chat(500_000), "at most 10000 messages"),
    (
        "chat-200k-image-parts", "Chat",
        lambda: pb.ChatRequest(messages=[pb.ChatMessage(role="user", parts=[IMAGE_PART] * 200_000)]),
        "may hold at most 10000 content parts",
    ),
    (
        "tokenize-1M-turns", "Tokenize", lambda: pb.TokenizeRequest(messages=[HI] * 1_000_000),
        "may hold at most 10000 messages",
    ),
    ("chat-17-stops", "Chat", lambda: _chat(stop=["x"] * 17), "may hold at most 16 stop strings"),
    (
        "complete-17-stops", "Complete",
        lambda: pb.CompletionRequest(prompt="Once", params=pb.TextSamplingParams(stop=["x"] * 17)),
        "at most 16 stop strings",
    ),
    ("chat-5KB-stop", "Chat", lambda: _chat(stop=["x" * 5000]), "at most 4096 characters, not 5000"),
    (
        "completestream-5KB-stop", "CompleteStream",
        lambda: pb.CompletionRequest(prompt="O", params=pb.TextSamplingParams(stop=["x" * 5000])),
        "at most 4096 characters",
    ),
    # 32 MB of empty turns would parse into 16M objects (1 GB): counted on the wire first
    ("chat-16M-empty-turns", "Chat", lambda: b"\x12\x00" * 16_000_000, "at most 10000 messages"),
    ("chat-16M-model-fields", "Chat", lambda: b"\x0a\x00" * 16_000_000, "holds over 40256 fields"),
]  # fmt: skip


@pytest.fixture(scope="module")
def big_stack(tokenizer: Tokenizer) -> Iterator[Stack]:  # noqa: F811
    """A gateway with the default body cap (32 MiB), so REST bodies reach the limits."""
    s = start_stack(tokenizer, api_key=API_KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def channel(big_stack: Stack) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(big_stack.grpc_address, options) as ch:
        yield ch


@pytest.fixture(scope="module")
def rest(big_stack: Stack) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=big_stack.base_url, headers=headers, timeout=60) as client:
        yield client


def call_raw(
    channel: grpc.Channel, method: str, raw: bytes, auth: Any = AUTH
) -> tuple[grpc.StatusCode, str]:
    """`raw` as the request of `method`, sent without a serializer: the status and details."""
    try:
        if method in STREAMING:
            list(channel.unary_stream(SERVICE + method)(raw, metadata=auth, timeout=60))
        else:
            channel.unary_unary(SERVICE + method)(raw, metadata=auth, timeout=60)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    ("case", "method", "request_of", "needle"), OVERSIZED, ids=[c[0] for c in OVERSIZED]
)
def test_oversized_grpc_fields_are_refused_before_the_work(
    channel: grpc.Channel, case: str, method: str, request_of: Callable[[], Any], needle: str
) -> None:
    request = request_of()
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    walls = []
    for _ in range(RUNS):
        start = time.perf_counter()
        code, details = call_raw(channel, method, raw)
        walls.append(time.perf_counter() - start)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
    median = statistics.median(walls)
    print(f"{case}: {len(raw) / 1e6:.2f} MB, median {median * 1000:.1f} ms of {RUNS}")
    assert median < 1.0


def test_the_limits_themselves_are_accepted(channel: grpc.Channel, big_stack: Stack) -> None:
    stops = [chr(ord("a") + i) * MAX_STOP_CHARS for i in range(MAX_STOP)]
    assert call_raw(channel, "Chat", _chat(stop=stops).SerializeToString())[0] == grpc.StatusCode.OK
    parts = [pb.ContentPart(text="a ")] * MAX_CONTENT_PARTS
    tokenize = pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", parts=parts)])
    assert call_raw(channel, "Tokenize", tokenize.SerializeToString())[0] == grpc.StatusCode.OK
    code, details = call_raw(channel, "Chat", _chat(MAX_MESSAGES).SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context length" in details  # not a count


def test_garbage_without_the_token_is_unauthenticated(channel: grpc.Channel) -> None:
    code, details = call_raw(channel, "Chat", b"\xff\xff\xff\xff\x0f", auth=())
    assert code == grpc.StatusCode.UNAUTHENTICATED and "ChatRequest" not in details


REST_CASES: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("17-stops", "/v1/chat/completions", {"stop": ["x"] * 17},
     "'stop' may hold at most 16 stop strings, not 17", "stop"),
    ("5KB-stop", "/v1/completions", {"prompt": "Once", "stop": "x" * 5000},
     "'stop' strings may be at most 4096 characters, not 5000", "stop"),
    ("5KB-stop-in-array", "/v1/chat/completions", {"stop": ["a", "x" * 5000]},
     "at most 4096 characters", "stop"),
    ("10001-turns", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)},
     "'messages' may hold at most 10000 messages, not 10001", "messages"),
    ("10001-parts", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 10001}]},
     "'messages' may hold at most 10000 content parts, not 10001", "messages"),
    ("tokenize-10001-turns", "/tokenize",
     {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)},
     "at most 10000 messages", "messages"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "path", "fields", "message", "param"), REST_CASES, ids=[c[0] for c in REST_CASES]
)
def test_rest_says_the_same_limits(
    rest: httpx.Client, case: str, path: str, fields: dict[str, Any], message: str, param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    if path == "/v1/completions":
        body.pop("messages")
    if path == "/tokenize":
        body = fields
    reply = rest.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param, error


def test_rest_accepts_the_stop_limits(rest: httpx.Client) -> None:
    stops = [chr(ord("a") + i) * MAX_STOP_CHARS for i in range(MAX_STOP)]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": stops}
    assert rest.post("/v1/chat/completions", json=body).status_code == 200


# -- images: the count on the proto, and error texts without addresses --------------------


@pytest.fixture(scope="module")
def vlm_stack(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Stack]:
    model_dir = build_tiny_llava(tmp_path_factory.mktemp("llava"), default_model_dir)
    s = start_stack(Tokenizer.load(model_dir), model=str(model_dir), api_key=API_KEY)
    yield s
    s.stop()


def _image_chat(*images: bytes) -> bytes:
    parts = [pb.ContentPart(text="What is this?")]
    parts += [pb.ContentPart(image=pb.Image(data=d, mime_type="image/png")) for d in images]
    return pb.ChatRequest(messages=[pb.ChatMessage(role="user", parts=parts)]).SerializeToString()


def test_image_count_is_refused_on_the_proto(vlm_stack: Stack) -> None:
    vlm_stack.engine.reset()
    png = png_bytes(sample_image(1))
    limit = vlm_stack.gateway.config.limit_images_per_prompt
    with grpc.insecure_channel(vlm_stack.grpc_address) as channel:
        code, details = call_raw(channel, "Chat", _image_chat(*[png] * (limit + 1)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == f"{limit + 1} images in one prompt, over the limit of {limit}"
        assert vlm_stack.engine.requests == []
        assert call_raw(channel, "Chat", _image_chat(png))[0] == grpc.StatusCode.OK


def test_text_only_model_refuses_image_parts_on_the_proto(channel: grpc.Channel) -> None:
    code, details = call_raw(channel, "ChatStream", _image_chat(png_bytes(sample_image(1))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "text-only" in details


def test_bad_image_errors_carry_no_addresses(vlm_stack: Stack) -> None:
    with grpc.insecure_channel(vlm_stack.grpc_address) as channel:
        code, details = call_raw(channel, "Chat", _image_chat(b"not an image"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "PNG, JPEG or WebP" in details
    url = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    content = [{"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(f"{vlm_stack.base_url}/v1/chat/completions", json=body, headers=headers)
    message = reply.json()["error"]["message"]
    assert reply.status_code == 400 and "PNG, JPEG or WebP" in message
    for text in (details, message):
        assert "0x" not in text and " object at " not in text, text


def test_object_reprs_are_redacted() -> None:
    text = "cannot identify image file <_io.BytesIO object at 0x7f3a2c1d9e40>"
    assert redact_addresses(text) == "cannot identify image file"
    assert InvalidRequest(f"bad ({text})").message == "bad (cannot identify image file)"
    keep = "'stop' may hold at most 16 stop strings; got <3> at 0x"  # no repr: kept as is
    assert redact_addresses(keep) == keep
