"""One request over EngineCore's GenerateStream session, read like a server-streaming call.

Tests that drive the scheduler's gRPC service directly use this; the gateway multiplexes
many requests on one session with `gateway.engine_client`. A rejection of the request (a
RequestRejection in the session's messages) is raised as the gRPC error it names, so a test
reads the same status codes whichever side of the session refused the request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from services.pb import engine_pb2, engine_pb2_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _one(msg: engine_pb2.EngineCoreRequest) -> Iterator[engine_pb2.EngineCoreCommand]:
    """The session's input: one add, then the client's side closes."""
    return iter([engine_pb2.EngineCoreCommand(add=msg)])


def _outputs(batch: engine_pb2.EngineCoreOutputs) -> list[engine_pb2.EngineCoreOutput]:
    for rejection in batch.rejections:
        code = _CODES.get(rejection.code, grpc.StatusCode.UNKNOWN)
        raise grpc.aio.AioRpcError(code, details=rejection.message)
    return list(batch.outputs)


class OneRequest:
    """The outputs of one request on its own session (grpc.aio); `cancel()` aborts it."""

    def __init__(
        self,
        stub: engine_pb2_grpc.EngineCoreStub,
        msg: engine_pb2.EngineCoreRequest,
        timeout: float | None = None,
    ) -> None:
        self._call = stub.GenerateStream(_one(msg), timeout=timeout)
        self._pending: deque[engine_pb2.EngineCoreOutput] = deque()

    async def read(self) -> Any:  # an EngineCoreOutput, or grpc.aio.EOF
        """The next output, or grpc.aio.EOF once the request has finished."""
        while not self._pending:
            batch = await self._call.read()
            if batch is grpc.aio.EOF:
                return grpc.aio.EOF
            self._pending.extend(_outputs(batch))
        return self._pending.popleft()

    async def __aiter__(self) -> AsyncIterator[engine_pb2.EngineCoreOutput]:
        while (out := await self.read()) is not grpc.aio.EOF:
            yield out

    def cancel(self) -> None:
        self._call.cancel()


def generate_sync(
    stub: engine_pb2_grpc.EngineCoreStub, msg: engine_pb2.EngineCoreRequest, timeout: float
) -> list[engine_pb2.EngineCoreOutput]:
    """Every output of one request, over a blocking channel."""
    return [
        out for batch in stub.GenerateStream(_one(msg), timeout=timeout) for out in _outputs(batch)
    ]
