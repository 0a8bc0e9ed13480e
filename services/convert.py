"""Protobuf <-> domain conversion.

Every domain type (services.types, services.step_types) is generated with its converters
from its message in protos/ (services/wire.py, `make proto`): `to_proto(obj, MessageClass)`
and `from_proto(msg, DomainType)` pick the straight-line pair. Rules: a None value leaves a
field unset and an unset field decodes to the Python default, so `Message()` decodes to
`DomainType()` (but for SamplingParams.max_tokens: unset is None, up to max_model_len, while
SamplingParams() means vLLM's 16); repeated fields are lists (tuples where the type says so).
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf.message import Message

from services import wire

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def to_proto(obj: Any, message_cls: type[M]) -> M:
    """Build a `message_cls` from a domain object."""
    return fill_proto(message_cls(), obj)


def fill_proto(msg: M, obj: Any) -> M:
    """Fill an existing message (e.g. `repeated.add()`, which avoids a copy) from `obj`."""
    _check(type(obj), type(msg))
    wire.FILL[type(obj)](msg, obj)
    return msg


def from_proto(msg: Message, cls: type[T]) -> T:
    """Build a domain object `cls` from its message."""
    _check(cls, type(msg))
    result: T = wire.READ[cls](msg)
    return result


def _check(cls: type, message_cls: type[Message]) -> None:
    if wire.MESSAGES.get(cls) is not message_cls:
        raise TypeError(f"{cls.__name__} does not travel as {message_cls.__name__}")


# The pairs the services exchange, for callers that want them by name.
PAIRS: list[tuple[type, type[Message]]] = list(wire.MESSAGES.items())
