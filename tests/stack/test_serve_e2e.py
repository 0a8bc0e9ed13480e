"""`tessera serve` end to end: three real processes on loopback, the real default model,
driven by the official openai client (issue 6, acceptance 1, 3, 4, 6)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from benchmarks.stack import Stack, start_stack
from services.convert import from_proto
from services.grpc_utils import sync_channel
from services.pb import engine_pb2, engine_pb2_grpc
from services.step_types import SchedulerStats

pytestmark = pytest.mark.slow
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = start_stack()  # the defaults: bf16, default model
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def scheduler_stats(stack: Stack) -> SchedulerStats:
    with sync_channel(stack.scheduler_address, security=stack.internal) as channel:
        reply = engine_pb2_grpc.EngineCoreStub(channel).GetStats(engine_pb2.GetStatsRequest())
    return from_proto(reply, SchedulerStats)


def wait_idle(stack: Stack, timeout_s: float) -> SchedulerStats:
    """Poll until no request runs or waits and no block is used (or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    stats = scheduler_stats(stack)
    while time.monotonic() < deadline and (
        stats.num_running or stats.num_waiting or stats.num_blocks_used
    ):
        time.sleep(0.05)
        stats = scheduler_stats(stack)
    return stats


def test_chat_answers_paris_streaming_and_not(stack: Stack) -> None:
    client: Any = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=32
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text
    assert text == reply.choices[0].message.content


def test_64_concurrent_streams_count_usage_and_free_every_block(stack: Stack) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model=model, prompt=f"Request {i}: tell me about the number {i}.", max_tokens=8 + i % 24,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        usage, text = None, ""
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        assert usage is not None
        return usage.prompt_tokens, usage.completion_tokens, text

    async def run() -> list[tuple[int, int, str]]:
        client = openai.AsyncOpenAI(
            base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0
        )
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    model = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x").models.list().data[0].id
    results = asyncio.run(run())
    for i, (prompt_tokens, completion_tokens, text) in enumerate(results):
        expected_prompt = len(_tokenize(stack, f"Request {i}: tell me about the number {i}."))
        assert (prompt_tokens, completion_tokens) == (expected_prompt, 8 + i % 24)
        assert text
    stats = wait_idle(stack, 2.0)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


def test_dropped_streams_leave_nothing_behind(stack: Stack) -> None:
    async def keep(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.completions.create(
            model=model,
            prompt=f"Story {i}:",
            max_tokens=16,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            pass

    async def drop(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.completions.create(
            model=model, prompt=f"Long story {i}:", max_tokens=4000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()

    async def run() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0
        )
        await asyncio.gather(
            *(keep(client, i) for i in range(20)), *(drop(client, i) for i in range(20))
        )

    model = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x").models.list().data[0].id
    asyncio.run(run())
    stats = wait_idle(stack, 1.0)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


def test_reflection_lists_the_services_of_all_three_processes(stack: Stack) -> None:
    expected = {
        stack.worker_address: "tessera.v1.Worker",
        stack.scheduler_address: "tessera.v1.EngineCore",
        stack.gateway_grpc_address: "tessera.v1.TextGeneration",
    }
    for address, service in expected.items():
        with grpc.insecure_channel(address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {service, "grpc.health.v1.Health"} <= services, (address, services)


def _tokenize(stack: Stack, text: str) -> list[int]:
    import httpx

    reply = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": text}, timeout=10)
    reply.raise_for_status()
    return list(reply.json()["tokens"])
