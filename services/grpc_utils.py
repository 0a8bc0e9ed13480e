"""gRPC server and channel factories shared by the three services.

Every server gets the same message limits and keepalive, `grpc.health.v1`,
reflection, and an interceptor that turns exceptions into proper statuses.
A server with a token refuses calls without `authorization: Bearer <token>`
(UNAUTHENTICATED; health and reflection stay open); with certificates it serves
TLS. Servers and channels made without an explicit `security` use the process's
internal one, set once at start-up by `set_internal_security`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.config import SecurityConfig
from services.security import bearer_matches, channel_credentials, server_credentials

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [  # GrpcServer adds grpc.max_receive_message_length
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
    # BDP probing grows each stream's flow-control window to MBs, which the transport then
    # buffers before it can refuse an oversized message: 8 clients sending 50 MB at once
    # grew the gateway by 30-144 MB; with a fixed window, by under 1 MB (a 20 MB message
    # arrives as fast over loopback).
    ("grpc.http2.bdp_probe", 0),
    *_KEEPALIVE,
]
# Idempotent internal unary calls, retried on UNAVAILABLE (a restarting peer) by gRPC itself.
IDEMPOTENT_METHODS = {
    "tessera.v1.EngineCore": ("GetServerInfo", "GetStats", "Abort"),
    "tessera.v1.Worker": ("GetModelInfo", "GetKVCacheSpec"),
    "grpc.health.v1.Health": ("Check",),
}
RETRY_POLICY = {
    "maxAttempts": 3,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [
                {"service": svc, "method": m} for svc, ms in IDEMPOTENT_METHODS.items() for m in ms
            ],
            "retryPolicy": RETRY_POLICY,
        }
    ]
}
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    # A restarted peer is found again within ~2 s (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    *_KEEPALIVE,
]

# Exceptions a handler may raise on purpose, and the status each becomes.
_STATUS_BY_EXCEPTION: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


# Methods any caller may use, token or not.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_internal_security = SecurityConfig()


def set_internal_security(config: SecurityConfig) -> None:
    """Set the token/TLS that this process's internal servers and channels use by default."""
    global _internal_security
    _internal_security = config


def internal_security() -> SecurityConfig:
    """The process's internal SecurityConfig (no token, plaintext until set)."""
    return _internal_security


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
        for kind in ("unary_stream", "stream_stream"):  # async generators, guarded alike
            if getattr(handler, kind):
                return handler._replace(
                    **{kind: _guard_stream(getattr(handler, kind), details.method)}
                )
        return handler


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without `authorization: Bearer <token>` (UNAUTHENTICATED), except
    health and reflection."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = details.invocation_metadata or ()
        header = next((str(v) for k, v in metadata if k == "authorization"), "")
        return handler if bearer_matches(header, self.token) else _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by an UNAUTHENTICATED abort."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await deny(request, context)
        yield None  # pragma: no cover (abort raised)

    kind = next(k for k in _HANDLER_KINDS if getattr(handler, k) is not None)
    return handler._replace(**{kind: deny_stream if kind.endswith("_stream") else deny})


_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


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


def _server_interceptors(
    security: SecurityConfig, first: Sequence[grpc.aio.ServerInterceptor]
) -> list[grpc.aio.ServerInterceptor]:
    auth = [TokenAuthInterceptor(security.token)] if security.token else []
    return [*first, *auth, ExceptionInterceptor()]


class GrpcServer:
    """An asyncio gRPC server with health, reflection and the exception interceptor.

    `security` (default: the process's internal one) adds the token check and TLS;
    `max_receive_bytes` caps one incoming message (default MAX_MESSAGE_BYTES);
    `interceptors` run before the token check and the exception interceptor.
    """

    def __init__(
        self,
        address: str,
        registrations: Sequence[Registration],
        *,
        security: SecurityConfig | None = None,
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        security = internal_security() if security is None else security
        options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_receive_bytes)]
        self.server = grpc.aio.server(
            interceptors=_server_interceptors(security, interceptors), options=options
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [r.service_name for r in registrations]
        for r in registrations:
            r.add_to_server(r.servicer, self.server)
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.service_names = names
        if security.tls:
            self.port = self.server.add_secure_port(address, server_credentials(security))
        else:
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


def _channel_options(security: SecurityConfig) -> list[tuple[str, Any]]:
    name = [("grpc.ssl_target_name_override", security.tls_server_name)]
    return [*CHANNEL_OPTIONS, *(name if security.tls_server_name else [])]


def aio_channel(address: str, *, security: SecurityConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel with the shared limits; sends the token and uses TLS as `security`
    (default: the process's internal one) says."""
    security = internal_security() if security is None else security
    options = _channel_options(security)
    interceptors = _aio_token_interceptors(security.token) if security.token else None
    if security.tls:
        creds = channel_credentials(security)
        return grpc.aio.secure_channel(address, creds, options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options, interceptors=interceptors)


def sync_channel(address: str, *, security: SecurityConfig | None = None) -> grpc.Channel:
    """A blocking channel with the shared limits, token and TLS as in `aio_channel`."""
    security = internal_security() if security is None else security
    options = _channel_options(security)
    if security.tls:
        channel = grpc.secure_channel(address, channel_credentials(security), options)
    else:
        channel = grpc.insecure_channel(address, options)
    if security.token:
        return grpc.intercept_channel(channel, _SyncTokenInterceptor(security.token))
    return channel


def check_health(
    address: str,
    service: str = "",
    timeout_s: float = 2.0,
    *,
    security: SecurityConfig | None = None,
) -> bool:
    """True when the server at `address` reports SERVING for `service` ("" = the whole server)."""
    status = health_status(address, service, timeout_s, security=security)
    return status == health_pb2.HealthCheckResponse.SERVING


def health_status(
    address: str,
    service: str = "",
    timeout_s: float = 2.0,
    *,
    security: SecurityConfig | None = None,
) -> int | None:
    """The grpc.health.v1 status the server at `address` reports for `service`, or None when
    it does not answer (a server that answers NOT_SERVING is up, e.g. a worker waiting for
    its KV handshake)."""
    with sync_channel(address, security=security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return None
    return int(reply.status)


def _bearer(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")


class _AioToken:
    """Adds `authorization: Bearer <token>` to a call's metadata (asyncio channels)."""

    def __init__(self, token: str) -> None:
        self.header = _bearer(token)

    def _details(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.header)
        return details._replace(metadata=metadata)


# grpc.aio files each interceptor under the first kind it is an instance of: one class per kind.
class _AioTokenUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioTokenUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioTokenStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _AioTokenStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def _aio_token_interceptors(token: str) -> list[Any]:
    kinds = (_AioTokenUnaryUnary, _AioTokenUnaryStream, _AioTokenStreamUnary, _AioTokenStreamStream)
    return [kind(token) for kind in kinds]


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self.header = _bearer(token)

    def _details(self, d: Any) -> Any:
        metadata = [*(d.metadata or ()), self.header]
        return _CallDetails(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready,
            getattr(d, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
