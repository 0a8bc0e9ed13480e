"""gRPC server and channel factories shared by the three services.

Every server gets the same message limits and keepalive, `grpc.health.v1`,
reflection, and an interceptor that turns exceptions into proper statuses.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
    *_KEEPALIVE,
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *_KEEPALIVE,
]

# Exceptions a handler may raise on purpose, and the status each becomes.
_STATUS_BY_EXCEPTION: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status an exception maps to (INTERNAL when nothing more specific fits)."""
    for exc_type, code in _STATUS_BY_EXCEPTION:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


@dataclass(frozen=True)
class Registration:
    """One servicer to put on a server."""

    service_name: str  # full name, e.g. "tessera.v1.Worker"
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


class ExceptionInterceptor(grpc.aio.ServerInterceptor):
    """Turn an exception escaping a handler into a status with its message; the server lives on."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if handler.unary_unary:
            return handler._replace(unary_unary=_guard_unary(handler.unary_unary, details.method))
        if handler.unary_stream:
            return handler._replace(
                unary_stream=_guard_stream(handler.unary_stream, details.method)
            )
        return handler


def _guard_unary(fn: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except Exception as exc:
            await _abort(context, exc, method)

    return wrapper


def _guard_stream(fn: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
        except Exception as exc:
            await _abort(context, exc, method)

    return wrapper


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # the handler already chose a status
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    await context.abort(
        code, f"{type(exc).__name__}: {exc}" if code == grpc.StatusCode.INTERNAL else str(exc)
    )


class GrpcServer:
    """An asyncio gRPC server with health, reflection and the exception interceptor."""

    def __init__(self, address: str, registrations: Sequence[Registration]) -> None:
        self.server = grpc.aio.server(interceptors=[ExceptionInterceptor()], options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [r.service_name for r in registrations]
        for r in registrations:
            r.add_to_server(r.servicer, self.server)
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.service_names = names
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for the whole server and each service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting calls and give in-flight ones `grace_s` seconds to finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def aio_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel with the shared limits."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def sync_channel(address: str) -> grpc.Channel:
    """A blocking channel with the shared limits."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def check_health(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when the server at `address` reports SERVING for `service` ("" = the whole server)."""
    with sync_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
