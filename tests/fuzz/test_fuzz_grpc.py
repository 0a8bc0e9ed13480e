"""Fuzzing the public gRPC API (tessera.v1.TextGeneration) with raw bytes: random blobs,
truncated and byte-flipped valid requests, sent to every method of a live gateway (fake
engine) by a generic channel without serializers. Bytes that do not parse as the method's
request give INVALID_ARGUMENT with a generic message naming only the message type; bytes
that do parse are answered with anything but UNKNOWN or INTERNAL; the server stays healthy.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from services.grpc_utils import check_health
from services.pb import generate_pb2 as pb
from tests.gateway.conftest import API_KEY, Stack, stack, tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow
SERVICE = "/tessera.v1.TextGeneration/"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
PARAMS = pb.TextSamplingParams(max_tokens=3, temperature=0.5, stop=["xyz"], seed=7)
HELLO = pb.ChatMessage(role="user", content="Say hello.")
PARTS = pb.ChatMessage(role="user", parts=[pb.ContentPart(text="Hi "), pb.ContentPart(text="you")])
# method -> (its request type, streams its answer, a valid request)
METHODS: dict[str, tuple[Any, bool, Any]] = {
    "Complete": (pb.CompletionRequest, False, pb.CompletionRequest(prompt="Once", params=PARAMS)),
    "CompleteStream": (
        pb.CompletionRequest, True, pb.CompletionRequest(prompt="Once", params=PARAMS, priority=3),
    ),
    "Chat": (pb.ChatRequest, False, pb.ChatRequest(messages=[HELLO, PARTS], params=PARAMS)),
    "ChatStream": (
        pb.ChatRequest, True, pb.ChatRequest(messages=[HELLO], params=PARAMS, request_id="r-1"),
    ),
    "ListModels": (pb.ListModelsRequest, False, pb.ListModelsRequest()),
    "Tokenize": (
        pb.TokenizeRequest, False,
        pb.TokenizeRequest(text="hello", messages=[HELLO], add_special_tokens=True),
    ),
}  # fmt: skip
SEEDS = [0, 1, 2, 3]
BLOBS_PER_SEED = 25


@pytest.fixture(scope="module")
def channel(stack: Stack) -> Iterator[grpc.Channel]:  # noqa: F811
    with grpc.insecure_channel(stack.grpc_address) as ch:
        yield ch


def call_raw(channel: grpc.Channel, method: str, raw: bytes) -> tuple[grpc.StatusCode, str]:
    """Send `raw` as the request of `method` (no serializer); the status and its details."""
    streams = METHODS[method][1]
    path = SERVICE + method
    try:
        if streams:
            list(channel.unary_stream(path)(raw, metadata=AUTH, timeout=30))
        else:
            channel.unary_unary(path)(raw, metadata=AUTH, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def parses(method: str, raw: bytes) -> bool:
    try:
        METHODS[method][0].FromString(raw)
    except Exception:
        return False
    return True


def check(channel: grpc.Channel, method: str, raw: bytes) -> bool:
    """Send `raw`, assert the answer fits the contract; True if `raw` does not parse."""
    code, details = call_raw(channel, method, raw)
    assert "DecodeError" not in details and "<class" not in details, (method, raw, details)
    if parses(method, raw):
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (raw, details)
        return False
    name = METHODS[method][0].DESCRIPTOR.full_name
    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {name}",
    ), (method, raw)  # fmt: skip
    return True


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("seed", SEEDS)
def test_random_bytes_are_invalid_argument(channel: grpc.Channel, method: str, seed: int) -> None:
    rng = random.Random(f"{method}-{seed}")
    blobs = [rng.randbytes(rng.randint(1, 300)) for _ in range(BLOBS_PER_SEED)]
    undecodable = sum(check(channel, method, blob) for blob in blobs)
    assert undecodable >= BLOBS_PER_SEED // 2  # the test exercised the refusal


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ListModels"])
def test_truncated_valid_requests(channel: grpc.Channel, method: str) -> None:
    raw = METHODS[method][2].SerializeToString()
    undecodable = sum(check(channel, method, raw[:cut]) for cut in range(1, len(raw)))
    assert undecodable > 0
    assert call_raw(channel, method, raw)[0] == grpc.StatusCode.OK


@pytest.mark.parametrize("method", list(METHODS))
def test_byte_flipped_valid_requests(channel: grpc.Channel, method: str) -> None:
    raw = METHODS[method][2].SerializeToString() or b"\x08\x01"
    rng = random.Random(method)
    for _ in range(40):
        flipped = bytearray(raw)
        flipped[rng.randrange(len(raw))] = rng.randrange(256)
        check(channel, method, bytes(flipped))


def test_server_healthy_after_fuzzing(stack: Stack, channel: grpc.Channel) -> None:  # noqa: F811
    for method in METHODS:  # garbage on every method, then good requests on every method
        check(channel, method, b"\xff\xff\xff\xff\x0f")
    assert check_health(stack.grpc_address, "tessera.v1.TextGeneration")
    for method, (_, _, valid) in METHODS.items():
        assert call_raw(channel, method, valid.SerializeToString())[0] == grpc.StatusCode.OK
