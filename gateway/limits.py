"""Size limits of a request, counted before anything is converted (REST: on the decoded
JSON, gRPC: on the proto), so an oversized request costs no more than counting it.

The checks raise ValueError (what pydantic validators raise); gateway.protocol runs them as
validators of its request models, gateway.grpc_api on the proto fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 4096  # characters of one stop string
MAX_MESSAGES = 10_000  # turns of one chat
MAX_CONTENT_PARTS = 10_000  # content parts of one chat, all turns together


def limit_count(name: str, count: int, limit: int, what: str) -> None:
    """ValueError unless `count` <= `limit` (`what`: the things counted, e.g. "messages")."""
    if count > limit:
        raise ValueError(f"'{name}' may hold at most {limit} {what}, not {count}")


def check_stop(stop: Sequence[Any]) -> None:
    """ValueError unless `stop` holds at most MAX_STOP strings of MAX_STOP_CHARS at most."""
    limit_count("stop", len(stop), MAX_STOP, "stop strings")
    longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(
            f"'stop' strings may be at most {MAX_STOP_CHARS} characters, not {longest}"
        )


def check_chat_size(turns: int, parts_per_turn: Iterable[int]) -> None:
    """ValueError unless a chat has at most MAX_MESSAGES turns and MAX_CONTENT_PARTS parts
    (`parts_per_turn` is only read once the turns fit)."""
    limit_count("messages", turns, MAX_MESSAGES, "messages")
    limit_count("messages", sum(parts_per_turn), MAX_CONTENT_PARTS, "content parts")


def stop_size(stop: Any) -> Any:
    """Validator (before): the `stop` field's limits."""
    if isinstance(stop, str | list):
        check_stop([stop] if isinstance(stop, str) else stop)
    return stop


def chat_size(messages: Any) -> Any:
    """Validator (before): the limits of a `messages` field, on the decoded JSON."""
    if isinstance(messages, list):
        parts = (
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), list)
        )
        check_chat_size(len(messages), parts)
    return messages
