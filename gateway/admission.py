"""A ceiling on the bytes of requests the gateway holds at once, for REST and gRPC.

Every REST body chunk and every gRPC request message is counted against one
`ByteBudget` while its request is in flight; past the ceiling the request is
refused (429 / RESOURCE_EXHAUSTED) before more memory goes to it. With the
per-request caps (body size, prompt characters) this bounds the gateway's memory
under any mix of concurrent large requests.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import TooManyRequests

# Copies of a request's bytes the gateway holds while parsing it (received chunks or the
# gRPC message, the joined body or parsed proto, the decoded text): each byte is charged this
# many times, so the budget tracks memory rather than wire bytes.
COPIES = 3


class ByteBudget:
    """Memory held by in-flight requests (COPIES x their bytes), never above `limit`
    (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def try_acquire(self, num_bytes: int) -> bool:
        """Charge `num_bytes` of request (COPIES times) if that fits under the limit."""
        cost = COPIES * num_bytes
        with self._lock:
            if self.used + cost > self.limit:
                return False
            self.used += cost
            return True

    def release(self, num_bytes: int) -> None:
        """Undo `try_acquire(num_bytes)`."""
        with self._lock:
            self.used -= COPIES * num_bytes

    def refusal(self, num_bytes: int) -> TooManyRequests:
        return TooManyRequests(
            f"the server holds too much request data right now ({self.used} of {self.limit} "
            f"bytes of memory budget; this request needs {COPIES * num_bytes} more); retry later"
        )


class BodyBudgetMiddleware:
    """ASGI: counts each request body against the budget until the request ends; a body
    whose declared length cannot fit gets 429 at once, a chunk past the ceiling raises
    TooManyRequests inside the route (rendered as 429 in the OpenAI error shape)."""

    def __init__(self, app: ASGIApp, budget: ByteBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = 0

        async def counted_receive() -> Message:
            nonlocal held
            message = await receive()
            size = len(message.get("body", b""))
            if message["type"] == "http.request" and size:
                if not self.budget.try_acquire(size):
                    raise self.budget.refusal(size)
                held += size
            return message

        try:
            await self.app(scope, counted_receive, send)
        finally:
            self.budget.release(held)


@dataclass(frozen=True)
class _Held:
    message: Any
    size: int


_REFUSED = object()


class MessageBudgetInterceptor(grpc.aio.ServerInterceptor):
    """gRPC: counts each unary request message against the budget until its call ends;
    a message past the ceiling ends the call with RESOURCE_EXHAUSTED before any handler
    (or auth check) sees it. Put it first among a server's interceptors."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = self._deserializer(handler.request_deserializer)
        if handler.unary_unary:
            unary = self._unary(handler.unary_unary)
            return handler._replace(request_deserializer=deserialize, unary_unary=unary)
        stream = self._stream(handler.unary_stream)
        return handler._replace(request_deserializer=deserialize, unary_stream=stream)

    def _deserializer(self, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        def deserialize(raw: bytes) -> Any:
            if not self.budget.try_acquire(len(raw)):
                return _REFUSED
            try:
                return _Held(parse(raw), len(raw))
            except BaseException:
                self.budget.release(len(raw))
                raise

        return deserialize

    async def _refuse(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.budget.refusal(0).message)

    def _unary(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is _REFUSED:
                await self._refuse(context)
            try:
                return await fn(request.message, context)
            finally:
                self.budget.release(request.size)

        return call

    def _stream(self, fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if request is _REFUSED:
                await self._refuse(context)
            try:
                async for item in fn(request.message, context):
                    yield item
            finally:
                self.budget.release(request.size)

        return call
