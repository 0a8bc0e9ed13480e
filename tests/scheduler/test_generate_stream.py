"""EngineCore.GenerateStream: many requests multiplexed on one call, through the gateway's
EngineClient and raw, against the real service, engine and Worker gRPC service (fake model)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from gateway.engine_client import EngineClient
from gateway.errors import InvalidRequest
from scheduler_service.session import Session
from services.convert import to_proto
from services.pb import engine_pb2
from services.types import EngineCoreRequest, FinishReason, SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import expected_tokens
from tests.scheduler.test_service import Stack, eventually, run

pytestmark = pytest.mark.timeout(60)


def request(request_id: str, prompt: list[int], **params: Any) -> EngineCoreRequest:
    params.setdefault("max_tokens", 8)
    return EngineCoreRequest(request_id, prompt, SamplingParams(**params))


async def collect(client: EngineClient, req: EngineCoreRequest) -> tuple[list[int], FinishReason]:
    tokens: list[int] = []
    reason = FinishReason.UNSPECIFIED
    async with client.generate(req) as stream:
        async for out in stream:
            tokens += out.new_token_ids
            reason = out.finish_reason
    return tokens, reason


def count_messages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the EngineCoreOutputs messages the server's sessions write (one per get())."""
    sent = [0]
    original = Session.get

    async def counting(self: Session) -> Any:
        msg = await original(self)
        if msg is not None:
            sent[0] += 1
        return msg

    monkeypatch.setattr(Session, "get", counting)
    return sent


def test_many_requests_share_one_call_with_one_message_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent = count_messages(monkeypatch)

    async def body() -> None:
        async with Stack(FakeWorker(step_delay_s=0.005), max_num_batched_tokens=64) as s:
            client = EngineClient(f"127.0.0.1:{s.server.port}")
            try:
                prompts = {f"m{i}": [10 * i + j for j in range(1, 4 + i)] for i in range(12)}
                results = await asyncio.gather(
                    *(collect(client, request(r, p, max_tokens=20)) for r, p in prompts.items())
                )
            finally:
                await client.close()
            for (rid, prompt), (tokens, reason) in zip(prompts.items(), results, strict=True):
                assert (tokens, reason) == (expected_tokens(prompt, 20), FinishReason.LENGTH), rid
            # 12 x 20 updates rode far fewer messages: about one per engine step
            assert sent[0] <= 40, sent[0]
            assert (await s.stats()).num_blocks_used == 0

    run(body)


def test_aborting_one_request_leaves_the_others_running() -> None:
    async def body() -> None:
        worker = FakeWorker(step_delay_s=0.01)
        async with Stack(worker) as s:
            client = EngineClient(f"127.0.0.1:{s.server.port}")
            try:
                others = [
                    asyncio.create_task(collect(client, request(f"o{i}", [5 + i], max_tokens=25)))
                    for i in range(3)
                ]
                seen = 0
                async with client.generate(request("victim", [1, 2, 3], max_tokens=500)) as v:
                    async for _ in v:
                        seen += 1
                        if seen == 3:
                            break  # leaving `async with` sends the abort on the stream
                engine = s.server.servicer.engine
                await eventually(lambda: _gone(engine, "victim"))
                results = await asyncio.gather(*others)
            finally:
                await client.close()
            for i, (tokens, reason) in enumerate(results):
                assert (tokens, reason) == (expected_tokens([5 + i], 25), FinishReason.LENGTH)
            assert "victim" not in worker.requests or await _eventually_dropped(worker)
            assert (await s.stats()).num_blocks_used == 0

    run(body)


async def _gone(engine: Any, request_id: str) -> bool:
    return request_id not in engine.scheduler.requests


async def _eventually_dropped(worker: FakeWorker) -> bool:
    await eventually(lambda: _not_held(worker, "victim"))
    return True


async def _not_held(worker: FakeWorker, request_id: str) -> bool:
    return request_id not in worker.requests


def test_a_broken_call_aborts_all_its_requests_and_frees_their_blocks() -> None:
    async def body() -> None:
        async with Stack(FakeWorker(step_delay_s=0.01)) as s:
            outbox: asyncio.Queue[Any] = asyncio.Queue()

            async def commands() -> Any:
                while True:
                    yield await outbox.get()

            call = s.stub.GenerateStream(commands())
            for i in range(5):
                add = to_proto(
                    request(f"b{i}", [1, 2, 3, i], max_tokens=500), engine_pb2.EngineCoreRequest
                )
                outbox.put_nowait(engine_pb2.EngineCoreCommand(add=add))
            seen: set[str] = set()
            while len(seen) < 5:
                msg = await call.read()
                seen.update(o.request_id for o in msg.outputs)
            assert (await s.stats()).num_running == 5
            assert (await s.stats()).num_blocks_used > 0
            call.cancel()  # the gateway went away
            await eventually(lambda: _idle(s))
            other = EngineClient(f"127.0.0.1:{s.server.port}")
            try:
                assert await collect(other, request("after", [7], max_tokens=3)) == (
                    [8, 9, 10],
                    FinishReason.LENGTH,
                )
            finally:
                await other.close()

    run(body)


async def _idle(s: Stack) -> bool:
    stats = await s.stats()
    return stats.num_running == stats.num_waiting == stats.num_blocks_used == 0


def test_rejections_carry_generates_status_codes() -> None:
    async def body() -> None:
        async with Stack(FakeWorker(max_model_len=64, step_delay_s=0.01)) as s:
            client = EngineClient(f"127.0.0.1:{s.server.port}")
            try:
                with pytest.raises(InvalidRequest, match="max_model_len"):
                    await collect(client, request("long", list(range(64))))
                running = asyncio.create_task(collect(client, request("dup", [1], max_tokens=30)))
                await eventually(lambda: _running(s, "dup"))
                raw = s.stub.GenerateStream()
                bad = engine_pb2.EngineCoreRequest(
                    request_id="temp",
                    prompt_token_ids=[1],
                    sampling_params=engine_pb2.SamplingParams(temperature=-1.0),
                )
                dup = to_proto(request("dup", [2]), engine_pb2.EngineCoreRequest)
                rejections = []
                for add in (bad, dup):
                    await raw.write(engine_pb2.EngineCoreCommand(add=add))
                    rejections += (await raw.read()).rejections
                assert [(r.request_id, r.code) for r in rejections] == [
                    ("temp", grpc.StatusCode.INVALID_ARGUMENT.value[0]),
                    ("dup", grpc.StatusCode.ALREADY_EXISTS.value[0]),
                ]
                assert "temperature" in rejections[0].message
                await raw.done_writing()
                assert await raw.read() is grpc.aio.EOF  # nothing of its own left: it ends
                assert (await running) == (expected_tokens([1], 30), FinishReason.LENGTH)
            finally:
                await client.close()

    run(body)


async def _running(s: Stack, request_id: str) -> bool:
    return request_id in s.server.servicer.engine.scheduler.requests


def test_a_broken_session_is_replaced_on_the_next_request() -> None:
    async def body() -> None:
        async with Stack(FakeWorker()) as s:
            client = EngineClient(f"127.0.0.1:{s.server.port}")
            try:
                assert (await collect(client, request("one", [1], max_tokens=2)))[0] == [2, 3]
                session = client._session
                assert session is not None
                session.close()  # as if the call broke
                await asyncio.sleep(0.05)
                assert (await collect(client, request("two", [4], max_tokens=2)))[0] == [5, 6]
                assert client._session is not session
            finally:
                await client.close()

    run(body)
