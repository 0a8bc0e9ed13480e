"""A test double of the scheduler's EngineCore, served over real gRPC.

GenerateStream streams, for every request of a session, the token ids of a fixed
answer (tokenized with the real tokenizer), one token per update, then EOS, each
update in its own EngineCoreOutputs message. It records every request it got, when
each request ended by cancellation (an abort command or a broken session), and every
Abort RPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from services.convert import from_proto, to_proto
from services.grpc_utils import GrpcServer, Registration
from services.pb import engine_pb2, engine_pb2_grpc
from services.step_types import SchedulerStats, ServerInfo
from services.types import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs

EOS = 2
MAX_MODEL_LEN = 512
MODEL_NAME = "fake-smollm"


def cached_tokens(prompt_len: int) -> int:
    """What the fake prefix cache reports for a prompt: whole 16-token blocks of half of it."""
    return (prompt_len // 2) // 16 * 16


def fake_vector(prompt: list[int]) -> list[float]:
    """The vector the fake answers an embedding request with."""
    return [float(len(prompt)), float(prompt[0]), 0.5, -1.0]


def fake_logprob(position: int) -> float:
    return -0.25 * (position + 1)


@dataclass
class FakeEngine(engine_pb2_grpc.EngineCoreServicer):
    answer_ids: list[int]
    token_delay_s: float = 0.0
    requests: list[EngineCoreRequest] = field(default_factory=list)
    cancelled_at: dict[str, float] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)
    fail_after: int | None = None  # send an ERROR output after this many tokens
    host_id: str = ""  # reported in ServerInfo: the gateway's host_id makes it send shm handles
    runner: str = "generate"  # reported in ServerInfo; "pooling": embedding requests answered

    def session_stats(self) -> SchedulerStats | None:
        """Figures to carry on each session message (None: none, as between a real
        scheduler's 0.1 s stats ticks)."""
        return None

    async def GenerateStream(self, request_iterator: Any, context: Any) -> Any:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks: dict[str, asyncio.Task[None]] = {}
        reader = asyncio.create_task(self._read_commands(request_iterator, queue, tasks))
        try:
            while True:
                yield await queue.get()
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()

    async def _read_commands(
        self, commands: Any, queue: asyncio.Queue[Any], tasks: dict[str, asyncio.Task[None]]
    ) -> None:
        async for command in commands:
            if command.WhichOneof("command") == "add":
                req = from_proto(command.add, EngineCoreRequest)
                tasks[req.request_id] = asyncio.create_task(self._run(req, queue))
            else:
                for request_id in command.abort.request_ids:
                    if request_id in tasks:
                        tasks[request_id].cancel()

    async def _run(self, req: EngineCoreRequest, queue: asyncio.Queue[Any]) -> None:
        """One request of a session: its updates onto the session's queue."""
        self.requests.append(req)
        self.started[req.request_id] = time.monotonic()
        finished = False
        try:
            for out in self._outputs(req):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                finished = out.finished
                msg = engine_pb2.EngineCoreOutputs()
                msg.outputs.append(to_proto(out, engine_pb2.EngineCoreOutput))
                if (stats := self.session_stats()) is not None:
                    msg.stats.CopyFrom(to_proto(stats, engine_pb2.SchedulerStats))
                queue.put_nowait(msg)
        finally:
            if not finished:  # aborted, or the session broke
                self.cancelled_at[req.request_id] = time.monotonic()

    def _outputs(self, req: EngineCoreRequest) -> Any:
        if req.pooling_params is not None:
            yield self._pooled(req)
            return
        params = req.sampling_params
        ids = [*self.answer_ids, EOS]
        limit = params.max_tokens or len(ids)
        for i, token in enumerate(ids[:limit]):
            out = EngineCoreOutput(req.request_id, [token])
            if i == 0:
                out.num_cached_tokens = cached_tokens(len(req.prompt_token_ids))
                out.prompt_logprobs = self._prompt_logprobs(req)
            if params.logprobs is not None:
                out.new_logprobs = [self._logprobs(token, i, params.logprobs)]
            if self.fail_after is not None and i >= self.fail_after:
                out.finish_reason, out.error, out.new_token_ids = FinishReason.ERROR, "boom", []
            elif token == EOS or token in params.stop_token_ids:
                out.finish_reason, out.stop_reason = FinishReason.STOP, token
            elif i == limit - 1:
                out.finish_reason = FinishReason.LENGTH
            yield out
            if out.finished:
                return

    def _pooled(self, req: EngineCoreRequest) -> EngineCoreOutput:
        """One final update with the vector [len(prompt), first id, 0.5, -1] (float32)."""
        if self.fail_after is not None:
            return EngineCoreOutput(req.request_id, finish_reason=FinishReason.ERROR, error="boom")
        vector = fake_vector(req.prompt_token_ids)
        out = EngineCoreOutput(req.request_id, finish_reason=FinishReason.STOP)
        out.pooling_output = struct.pack(f"<{len(vector)}f", *vector)
        return out

    def _logprobs(self, token: int, position: int, k: int) -> TokenLogprobs:
        top = [token, *range(100, 100 + k - 1)][:k] if k else []
        return TokenLogprobs(
            token, fake_logprob(position), 1, top, [fake_logprob(position)] * len(top)
        )

    def _prompt_logprobs(self, req: EngineCoreRequest) -> list[TokenLogprobs]:
        if req.sampling_params.prompt_logprobs is None:
            return []
        return [TokenLogprobs(t, -1.0, 1) for t in req.prompt_token_ids[1:]]

    async def Abort(self, request: Any, context: Any) -> Any:
        self.aborted.extend(request.request_ids)
        return engine_pb2.AbortResponse(num_aborted=len(request.request_ids))

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        info = ServerInfo(
            MODEL_NAME, MAX_MODEL_LEN, 49152, 16, 100, (EOS,), "test", "1", runner=self.runner
        )
        info = dataclasses.replace(info, host_id=self.host_id)
        return to_proto(info, engine_pb2.ServerInfo)

    async def GetStats(self, request: Any, context: Any) -> Any:
        stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=7)
        return to_proto(stats, engine_pb2.SchedulerStats)

    def cancelled(self) -> dict[str, float]:
        """cancelled_at of the requests started since the last reset: a request of an earlier
        test whose abort lands late is not counted."""
        return {rid: t for rid, t in self.cancelled_at.items() if rid in self.started}

    def reset(self) -> None:
        self.requests.clear()
        self.cancelled_at.clear()
        self.aborted.clear()
        self.started.clear()
        self.token_delay_s = 0.0
        self.fail_after = None


async def start_fake_engine(engine: FakeEngine) -> GrpcServer:
    """Serve `engine` on a free loopback port, reporting SERVING."""
    server = GrpcServer(
        "127.0.0.1:0",
        [
            Registration(
                "tessera.v1.EngineCore", engine_pb2_grpc.add_EngineCoreServicer_to_server, engine
            )
        ],
    )
    await server.start()
    await server.set_serving(True)
    return server
