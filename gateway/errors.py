"""Errors a client can cause, in OpenAI's shape and as gRPC statuses.

Handlers raise `ApiError` (or a subclass); the app turns it into
`{"error": {"message", "type", "param", "code"}}` with its HTTP status, the gRPC
API into the matching status code. Anything else is a bug and becomes a 500
without details. Messages lose the reprs of objects with memory addresses that library
errors quote (`<_io.BytesIO object at 0x7f...>`).
"""

from __future__ import annotations

from typing import Any

import grpc

from services.grpc_interceptors import redact_addresses

RETRY_AFTER_S = 1  # the Retry-After of a 503


class ApiError(Exception):
    """An error reported to the client."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        message = redact_addresses(message)
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers of the error response."""
        return {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(ApiError):
    """Malformed JSON, wrong types, out-of-range values, context overflow: 400."""


class PayloadTooLarge(ApiError):
    status = 413
    code = "payload_too_large"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class NotFound(ApiError):
    status = 404
    code = "not_found"
    grpc_code = grpc.StatusCode.NOT_FOUND


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(ApiError):
    status = 405
    code = "method_not_allowed"
    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class TooManyRequests(ApiError):
    """The admission limit (--max-queued-requests) is full: 429."""

    status = 429
    type = "rate_limit_error"
    code = "too_many_requests"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestTimeout(ApiError):
    """The request ran past its deadline (--request-timeout, its `timeout` field or the gRPC
    call deadline) and was aborted: 408; clients should not retry it as it is."""

    status = 408
    type = "timeout_error"
    code = "timeout"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED

    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "false"}  # the openai SDKs retry a 408 unless told not to


class ServiceUnavailable(ApiError):
    """The engine is down or the gateway is draining: 503."""

    status = 503
    type = "service_unavailable"
    code = "service_unavailable"
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)}  # the services come back by themselves


class EngineError(ApiError):
    """The engine failed a request it had accepted: 500 with the engine's message."""

    status = 500
    type = "internal_error"
    code = "engine_error"
    grpc_code = grpc.StatusCode.INTERNAL


def internal_error() -> ApiError:
    """The error shown for an unexpected exception (no details leak)."""
    return EngineError("internal error", code="internal_error")
