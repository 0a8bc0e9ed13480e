"""EngineCore's request validation through the real gRPC service (fake worker behind it):
each request below can never run correctly and must get INVALID_ARGUMENT before it queues."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
import pytest

from services.pb import engine_pb2, tensor_pb2
from tests.engine_session import OneRequest
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.test_service import Stack

pytestmark = pytest.mark.timeout(60)
VOCAB, MAX_LEN = 1000, 256  # the FakeWorker's
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def _request(**fields: Any) -> engine_pb2.EngineCoreRequest:
    params = fields.pop("params", {})
    msg = engine_pb2.EngineCoreRequest(request_id="v", prompt_token_ids=PROMPT, **fields)
    for name, value in params.items():
        if name == "logit_bias":
            msg.sampling_params.logit_bias.update(value)
        elif name == "stop_token_ids":
            msg.sampling_params.stop_token_ids.extend(value)
        else:
            setattr(msg.sampling_params, name, value)
    return msg


def _tensor() -> tensor_pb2.TensorHandle:
    return tensor_pb2.TensorHandle(dtype="float32", shape=[1], inline_bytes=b"\0" * 4)


def _mm(**fields: Any) -> engine_pb2.MultiModalInput:
    base: dict[str, Any] = {"modality": "image", "offset": 1, "length": 4, "tensor": _tensor()}
    base.update(fields)
    if base["tensor"] is None:
        del base["tensor"]
    return engine_pb2.MultiModalInput(**base)


async def _outcome(stack: Stack, msg: engine_pb2.EngineCoreRequest) -> tuple[Any, str]:
    """(status code, details) of a refused request, or (number of tokens, "") when it ran."""
    try:
        outputs = [o async for o in OneRequest(stack.stub, msg, timeout=20)]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return sum(len(o.new_token_ids) for o in outputs), ""


def _run(msg: engine_pb2.EngineCoreRequest) -> tuple[Any, str]:
    async def body() -> tuple[Any, str]:
        async with Stack(FakeWorker()) as stack:
            result = await _outcome(stack, msg)
            stats = await stack.stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            return result

    return asyncio.run(body())


def _assert_invalid(msg: engine_pb2.EngineCoreRequest, *words: str) -> None:
    code, details = _run(msg)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert all(w in details for w in words), details


def test_min_tokens_without_max_tokens_is_checked_against_max_model_len() -> None:
    # engine.proto: an unset max_tokens means "up to max_model_len", so 100 fits (not > 16)...
    tokens, _ = _run(_request(params={"min_tokens": 100}))
    assert tokens == MAX_LEN - len(PROMPT)
    # ...and a min_tokens past max_model_len can never be met
    _assert_invalid(_request(params={"min_tokens": MAX_LEN}), "max_model_len")


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, 2**31 - 1])
def test_out_of_vocabulary_stop_token_ids(bad: int) -> None:
    _assert_invalid(_request(params={"stop_token_ids": [2, bad], "max_tokens": 4}), "stop_token")


@pytest.mark.parametrize("bad", [VOCAB, 123_456])
def test_out_of_vocabulary_logit_bias_keys(bad: int) -> None:
    _assert_invalid(_request(params={"logit_bias": {3: 1.0, bad: 5.0}, "max_tokens": 4}), "bias")


@pytest.mark.parametrize(
    "item",
    [
        _mm(modality="smell"),
        _mm(modality=""),
        _mm(offset=-1),
        _mm(length=-2),
        _mm(length=0),
        _mm(offset=6, length=4),  # past the prompt's end
        _mm(offset=2**31 - 1),
        _mm(tensor=None),
    ],
    ids=["modality", "empty-modality", "neg-offset", "neg-length", "zero-length", "overrun",
         "huge-offset", "no-tensor"],
)  # fmt: skip
def test_malformed_mm_inputs(item: engine_pb2.MultiModalInput) -> None:
    _assert_invalid(_request(mm_inputs=[item], params={"max_tokens": 4}), "mm_inputs")


def test_overlapping_mm_inputs() -> None:
    items = [_mm(offset=0, length=4), _mm(offset=3, length=2)]
    _assert_invalid(_request(mm_inputs=items, params={"max_tokens": 4}), "mm_inputs")


@pytest.mark.parametrize("when", [math.nan, math.inf, -math.inf])
def test_non_finite_arrival_time(when: float) -> None:
    _assert_invalid(_request(arrival_time=when, params={"max_tokens": 4}), "arrival_time")
