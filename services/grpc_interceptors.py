"""The interceptors of Tessera's gRPC servers and channels (services.grpc_utils builds them in).

Server side: a request that does not parse gets INVALID_ARGUMENT naming only its message
type, exceptions escaping a handler become statuses with their message (object addresses
redacted), and a server with a token refuses calls without `authorization: Bearer <token>`
(UNAUTHENTICATED; health and reflection stay open). Client side: channels with a token send
that header on every call, asyncio or blocking.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from services.config import SecurityConfig
from services.security import bearer_matches

log = logging.getLogger(__name__)

# Exceptions a handler may raise on purpose, and the status each becomes.
_STATUS_BY_EXCEPTION: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


# Methods any caller may use, token or not.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


# `<_io.BytesIO object at 0x7f...>` and the like: the repr of an object, with its address.
_OBJECT_REPR = re.compile(r"\s*<[^<>]*\bat 0x[0-9a-fA-F]+>")


def redact_addresses(text: str) -> str:
    """`text` without the reprs of objects that give a memory address."""
    return _OBJECT_REPR.sub("", text)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status an exception maps to (INTERNAL when nothing more specific fits)."""
    for exc_type, code in _STATUS_BY_EXCEPTION:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


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
        if not handler.request_streaming and handler.request_deserializer is not None:
            handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
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
        return handler if carries_token(details, self.token) else _refusing(handler)


def carries_token(details: grpc.HandlerCallDetails, token: str) -> bool:
    """Whether a call's metadata holds `authorization: Bearer <token>`."""
    metadata = details.invocation_metadata or ()
    header = next((str(v) for k, v in metadata if k == "authorization"), "")
    return bearer_matches(header, token)


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


class RequestRefused(ValueError):
    """Raised by a request deserializer: the call ends with INVALID_ARGUMENT and this text."""


@dataclass(frozen=True)
class Undecodable:
    """What a guarded handler receives in place of a request that did not parse."""

    message: str  # the INVALID_ARGUMENT text


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`parse`, returning an Undecodable instead of raising (grpc would report UNKNOWN with
    the exception's class and text): a RequestRefused keeps its text, anything else says
    "request is not a valid <message type>"."""
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    generic = f"request is not a valid {getattr(descriptor, 'full_name', 'message')}"

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except RequestRefused as exc:
            return Undecodable(str(exc))
        except Exception:
            return Undecodable(generic)

    return deserialize


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _guard_unary(fn: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_undecodable(request, context)
        try:
            return await fn(request, context)
        except Exception as exc:
            await _abort(context, exc, method)

    return wrapper


def _guard_stream(fn: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _refuse_undecodable(request, context)
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
    text = f"{type(exc).__name__}: {exc}" if code == grpc.StatusCode.INTERNAL else str(exc)
    await context.abort(code, redact_addresses(text))


def server_interceptors(
    security: SecurityConfig, first: Sequence[grpc.aio.ServerInterceptor]
) -> list[grpc.aio.ServerInterceptor]:
    """A server's interceptors: `first`, then the token check (if any), then exceptions."""
    auth = [TokenAuthInterceptor(security.token)] if security.token else []
    return [*first, *auth, ExceptionInterceptor()]


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


def aio_token_interceptors(token: str) -> list[Any]:
    """Interceptors that send `token` on every kind of call of an asyncio channel."""
    kinds = (_AioTokenUnaryUnary, _AioTokenUnaryStream, _AioTokenStreamUnary, _AioTokenStreamStream)
    return [kind(token) for kind in kinds]


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class SyncTokenInterceptor(
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
