"""Size limits of a request, counted before anything is converted (REST: on the decoded
JSON, gRPC: on the wire bytes, before protobuf parses them), so an oversized request costs
no more than counting it.

The checks raise ValueError (what pydantic validators raise); gateway.protocol runs them as
validators of its request models. On gRPC a 32 MB message of empty turns would parse into
16M objects (1 GB, 0.8 s): `capped_parser` counts the repeated fields on the wire first and
refuses past the limits (RequestRefused: INVALID_ARGUMENT) having read at most a bounded
number of fields; long strings are skipped, not read.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.protobuf.descriptor import Descriptor

from services.grpc_interceptors import RequestRefused

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 4096  # characters of one stop string
MAX_MESSAGES = 10_000  # turns of one chat
MAX_CONTENT_PARTS = 10_000  # content parts of one chat, all turns together


# Repeated fields of the gRPC requests, by path: (limit, field named in the error, what).
WIRE_CAPS: dict[str, tuple[int, str, str]] = {
    "messages": (MAX_MESSAGES, "messages", "messages"),
    "messages.parts": (MAX_CONTENT_PARTS, "messages", "content parts"),
    "params.stop": (MAX_STOP, "stop", "stop strings"),
}
_ENTERED = {path.rsplit(".", 1)[0] for path in WIRE_CAPS if "." in path}  # messages to count in
# Fields the wire count reads at most: per turn its own, role, content; one per part; slack.
MAX_WIRE_FIELDS = 3 * MAX_MESSAGES + MAX_CONTENT_PARTS + 256


def too_many(name: str, limit: int, what: str) -> str:
    return f"'{name}' may hold at most {limit} {what}"


def limit_count(name: str, count: int, limit: int, what: str) -> None:
    """ValueError unless `count` <= `limit` (`what`: the things counted, e.g. "messages")."""
    if count > limit:
        raise ValueError(f"{too_many(name, limit, what)}, not {count}")


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


# Arguments of apply_chat_template that the server sets itself, never chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
     "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer_kwargs",
     "return_assistant_tokens_mask"}
)  # fmt: skip


def template_kwargs(kwargs: Any) -> Any:
    """Validator (before) of `chat_template_kwargs`: no argument the server sets itself."""
    if isinstance(kwargs, dict):
        taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if taken:
            raise ValueError(f"'chat_template_kwargs' may not set {', '.join(taken)}")
    return kwargs


def capped_parser(message: Any) -> Callable[[bytes], Any]:
    """`message.FromString` after `check_wire`; RequestRefused for anything it refuses."""
    invalid = f"request is not a valid {message.DESCRIPTOR.full_name}"

    def parse(raw: bytes) -> Any:
        check_wire(raw, message.DESCRIPTOR, invalid)
        try:
            return message.FromString(raw)
        except Exception:
            raise RequestRefused(invalid) from None

    return parse


def check_wire(raw: bytes, descriptor: Descriptor, invalid: str) -> None:
    """RequestRefused when the encoded `raw` holds more of a WIRE_CAPS field than its limit,
    more than MAX_WIRE_FIELDS fields where the count looks, or bytes that are not protobuf
    (`invalid`). Only messages on a WIRE_CAPS path are entered."""
    counts: Counter[str] = Counter()
    todo = [(0, len(raw), descriptor, "")]
    read = 0
    try:
        while todo:
            pos, end, desc, prefix = todo.pop()
            while pos < end:
                key, pos = _varint(raw, pos)
                read += 1
                if read > MAX_WIRE_FIELDS:
                    raise RequestRefused(f"the request holds over {MAX_WIRE_FIELDS} fields")
                pos, inner = _skip(raw, pos, key & 7)
                field = _fields_by_number(desc).get(key >> 3)
                if field is None:
                    continue
                path = prefix + field.name
                _count(counts, path)
                if path in _ENTERED and inner is not None and field.message_type is not None:
                    todo.append((inner, pos, field.message_type, path + "."))
            if pos != end:
                raise RequestRefused(invalid)
    except IndexError:
        raise RequestRefused(invalid) from None


@functools.cache
def _fields_by_number(descriptor: Descriptor) -> dict[int, Any]:
    """The message's fields by number (protobuf builds this dict anew on every access)."""
    return dict(descriptor.fields_by_number)


def _count(counts: Counter[str], path: str) -> None:
    cap = WIRE_CAPS.get(path)
    if cap is not None:
        counts[path] += 1
        if counts[path] > cap[0]:
            raise RequestRefused(too_many(cap[1], cap[0], cap[2]))


def _skip(raw: bytes, pos: int, wire_type: int) -> tuple[int, int | None]:
    """The position after a field's value, and where a length-delimited value starts."""
    if wire_type == 0:
        return _varint(raw, pos)[1], None
    if wire_type == 1:
        return pos + 8, None
    if wire_type == 5:
        return pos + 4, None
    if wire_type == 2:
        length, start = _varint(raw, pos)
        return start + length, start
    raise IndexError  # groups and reserved wire types: no proto3 message holds them


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError
