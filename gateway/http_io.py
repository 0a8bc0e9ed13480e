"""HTTP plumbing for the routes: bounded JSON bodies and racing work against a disconnect."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from gateway.errors import InvalidRequest, PayloadTooLarge

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `max_bytes`, 400 when it is not a JSON object."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"the body is {declared} bytes; the limit is {max_bytes}")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLarge(f"the body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    if not total:
        raise InvalidRequest("the body is empty; send a JSON object")
    return parse_json_object(b"".join(chunks))


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be a UTF-8 JSON object (no NaN or Infinity)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(data), "a number")
        raise InvalidRequest(f"the body must be a JSON object, not {kind}")
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first: then cancel it, raise ClientDisconnected.

    Call only after the body was read: the next ASGI message is then the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
