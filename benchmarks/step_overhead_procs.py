"""The two helper processes of the step-overhead benchmark: an instant fake worker behind
the real Worker gRPC service, and a client holding N concurrent generations (through the
gateway's EngineClient, one multiplexed GenerateStream call)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from gateway.engine_client import EngineClient
from services.pb import worker_pb2
from services.step_types import (
    KVCacheSpec,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerTimings,
)
from services.types import EngineCoreRequest, SamplingParams

BLOCK_SIZE = 16
PROMPT_LEN = 32


class InstantWorker:
    """WorkerProtocol without a model: one token per request whose prefill is complete."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.progress: dict[str, list[int]] = {}  # request id -> [num_tokens, num_computed]

    def get_model_info(self) -> ModelInfo:
        return ModelInfo("instant", 1 << 20, 50_000, (), "Instant", "float32", "cpu")

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, 1, 1, "float32", BLOCK_SIZE, 1)

    def determine_available_memory(self) -> int:
        return self.num_blocks

    def initialize_cache(self, num_blocks: int) -> int:
        return num_blocks

    def shutdown(self) -> None:
        self.progress.clear()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        for request_id in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.progress.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.progress[new.request_id] = [num_tokens, new.num_computed_tokens]
        out = ModelRunnerOutput(step_id=so.step_id)
        tokens = []
        for request_id, n in so.num_scheduled_tokens.items():
            state = self.progress[request_id]
            state[1] += n
            if state[1] == state[0]:
                state[0] += 1
                tokens.append([state[0] % 50_000])
            else:
                tokens.append([])
        out.set_sampled(list(so.num_scheduled_tokens), tokens)
        out.timings = WorkerTimings(total_ms=(time.perf_counter() - start) * 1e3)
        return out


def _timed(fn: Callable[..., Any], samples: dict[int, float]) -> Callable[..., Any]:
    """Wrap a conversion function; record its time per step for step messages."""

    def wrapper(value: Any, cls: Any) -> Any:
        start = time.perf_counter()
        result = fn(value, cls)
        if cls in (SchedulerOutput, worker_pb2.ModelRunnerOutput):
            step_id = result.step_id
            samples[step_id] = samples.get(step_id, 0.0) + time.perf_counter() - start
        return result

    return wrapper


def worker_process(conn: Connection, num_blocks: int) -> None:
    """Serve an InstantWorker; send the port, then per-step conversion times when told to stop."""
    import worker_service.server as ws

    samples: dict[int, float] = {}
    ws.from_proto = _timed(ws.from_proto, samples)
    ws.to_proto = _timed(ws.to_proto, samples)

    async def serve() -> None:
        server = ws.build_server("127.0.0.1:0", InstantWorker(num_blocks))
        await server.start()
        await server.set_serving(True)
        conn.send(server.port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        conn.send(samples)
        await server.stop(0.2)

    asyncio.run(serve())


# ---- the client process -------------------------------------------------------


def client_process(conn: Connection, address: str, num_requests: int, max_tokens: int) -> None:
    """Hold `num_requests` generations until told to stop; then send (tokens, updates)."""

    async def drive() -> None:
        counts, updates = [0] * num_requests, [0] * num_requests

        def request(i: int) -> EngineCoreRequest:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            prompt = [(i * 7 + j) % 50_000 for j in range(PROMPT_LEN)]
            return EngineCoreRequest(f"r{i}", prompt, params)

        async def generate(client: EngineClient, i: int) -> None:
            async with client.generate(request(i)) as stream:
                async for out in stream:
                    counts[i] += len(out.new_token_ids)
                    updates[i] += 1

        client = EngineClient(address)
        tasks = [asyncio.create_task(generate(client, i)) for i in range(num_requests)]
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        conn.send((sum(counts), sum(updates)))

    asyncio.run(drive())
