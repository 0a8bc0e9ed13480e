"""Pure ASGI middleware: request ids, API-key auth, access log and HTTP metrics.

Pure ASGI (not BaseHTTPMiddleware) so the `http.disconnect` message still
reaches the routes, which abort engine requests when a client goes away.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Collection
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import Unauthorized
from gateway.metrics import GatewayMetrics
from services.log import request_id_var
from services.security import bearer_matches

access_log = logging.getLogger("gateway.access")
_REQUEST_ID = re.compile(r"^[\w.:/@+=-]{1,128}$")
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class GatewayMiddleware:
    """Tags each HTTP request with an id, checks the API key, logs and counts it."""

    def __init__(
        self, app: ASGIApp, metrics: GatewayMetrics, routes: Collection[str], api_key: str = ""
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = frozenset(routes)
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _request_id(scope)
        token = request_id_var.set(rid)
        state: dict[str, Any] = {"status": 0, "start": time.perf_counter()}
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_with_id)
            else:
                await _send_json(
                    send_with_id, Unauthorized("missing or invalid API key").body(), 401
                )
        finally:
            self._record(scope, rid, state)
            request_id_var.reset(token)

    def _authorized(self, scope: Scope) -> bool:
        if not self.api_key or not scope["path"].startswith(PROTECTED_PREFIXES):
            return True
        if scope["method"] == "OPTIONS":
            return True  # CORS preflight carries no credentials
        return bearer_matches(_header(scope, b"authorization"), self.api_key)

    def _record(self, scope: Scope, rid: str, state: dict[str, Any]) -> None:
        path = scope["path"]
        route = path if path in self.routes else "other"
        status = state["status"] or 499  # no response started: the client went away
        self.metrics.http_requests.labels(route=route, status=str(status)).inc()
        access_log.info(
            "%s",
            json.dumps(
                {
                    "request_id": rid,
                    "method": scope["method"],
                    "path": path,
                    "status": status,
                    "duration_ms": round((time.perf_counter() - state["start"]) * 1000, 2),
                    "client": (scope.get("client") or ("-",))[0],
                }
            ),
        )


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def _request_id(scope: Scope) -> str:
    """The client's X-Request-Id when it is sane, else a fresh one."""
    given = _header(scope, b"x-request-id")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


async def _send_json(send: Send, body: dict[str, Any], status: int) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
