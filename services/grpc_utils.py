"""gRPC server and channel factories shared by the three services.

Every server gets the same message limits and keepalive, `grpc.health.v1`,
reflection, and an interceptor that turns exceptions into proper statuses.
A server with a token refuses calls without `authorization: Bearer <token>`
(UNAUTHENTICATED; health and reflection stay open), and a channel with one sends it
(the interceptors: services.grpc_interceptors); with certificates both use TLS. Servers and channels made without an explicit `security` use the process's
internal one, set once at start-up by `set_internal_security`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.config import SecurityConfig
from services.grpc_interceptors import (
    SyncTokenInterceptor,
    aio_token_interceptors,
    server_interceptors,
)
from services.security import channel_credentials, server_credentials

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

_internal_security = SecurityConfig()


def set_internal_security(config: SecurityConfig) -> None:
    """Set the token/TLS that this process's internal servers and channels use by default."""
    global _internal_security
    _internal_security = config


def internal_security() -> SecurityConfig:
    """The process's internal SecurityConfig (no token, plaintext until set)."""
    return _internal_security


@dataclass(frozen=True)
class Registration:
    """One servicer to put on a server."""

    service_name: str  # full name, e.g. "tessera.v1.Worker"
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


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
            interceptors=server_interceptors(security, interceptors), options=options
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
    interceptors = aio_token_interceptors(security.token) if security.token else None
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
        return grpc.intercept_channel(channel, SyncTokenInterceptor(security.token))
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
