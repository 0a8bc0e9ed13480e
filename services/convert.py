"""Protobuf <-> domain conversion.

Every domain dataclass in services.types / services.step_types has the same
field names as its protobuf message, so one generic pair of functions covers
them all: `to_proto(obj, MessageClass)` and `from_proto(msg, DataclassType)`.
The per-class plan (field kinds, nested types) is computed once and cached.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from services import step_types
from services import types as dt
from services.pb import engine_pb2, tensor_pb2, worker_pb2

T = TypeVar("T")
M = TypeVar("M", bound=Message)

# (name, reader: proto value -> domain value, writer: domain value -> proto, has presence)
_Field = tuple[str, Callable[[Any], Any], "Callable[[Message, str, Any], None]", bool]


def to_proto(obj: Any, message_cls: type[M]) -> M:
    """Build a `message_cls` from a domain dataclass with the same field names."""
    msg = message_cls()
    _fill(msg, obj)
    return msg


def _fill(msg: Message, obj: Any) -> None:
    """Write obj's fields into msg in place (nested messages are filled, never copied)."""
    for name, _, write, _ in _plan(type(obj), type(msg)):
        value = getattr(obj, name)
        if value is not None:
            write(msg, name, value)


def from_proto(msg: Message, cls: type[T]) -> T:
    """Build a domain dataclass `cls` from a message with the same field names."""
    kwargs = {}
    for name, read, _, has_presence in _plan(cls, type(msg)):
        if has_presence and not msg.HasField(name):
            continue  # unset: the dataclass default applies
        kwargs[name] = read(getattr(msg, name))
    return cls(**kwargs)


_PLANS: dict[tuple[type, type], list[_Field]] = {}


def _plan(cls: type, message_cls: type[Message]) -> list[_Field]:
    plan = _PLANS.get((cls, message_cls))
    if plan is None:
        plan = _PLANS[(cls, message_cls)] = _build_plan(cls, message_cls)
    return plan


def _build_plan(cls: type, message_cls: type[Message]) -> list[_Field]:
    hints = typing.get_type_hints(cls)
    by_name = message_cls.DESCRIPTOR.fields_by_name
    plan = []
    for f in dataclasses.fields(cls):
        fd = by_name.get(f.name)
        if fd is None:
            raise TypeError(f"{message_cls.__name__} has no field {f.name!r} ({cls.__name__})")
        read, write = _codec(_strip_optional(hints[f.name]), fd)
        plan.append((f.name, read, write, fd.has_presence and not _is_repeated(fd)))
    return plan


def _codec(hint: Any, fd: Any) -> tuple[Callable[[Any], Any], Callable[..., None]]:
    origin = typing.get_origin(hint)
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        return (lambda m: {key_t(k): val_t(v) for k, v in m.items()}), _write_map
    if _is_repeated(fd):
        (item_t, *_) = typing.get_args(hint) or (Any,)
        if fd.message_type is not None:
            return (lambda seq: [from_proto(m, item_t) for m in seq]), _write_repeated_messages
        container = tuple if origin is tuple else list
        return (lambda seq: container(seq)), _write_repeated
    if fd.message_type is not None:
        return (lambda m: from_proto(m, hint)), _write_message
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return (lambda v: hint(v)), lambda msg, name, v: setattr(msg, name, int(v))
    return (lambda v: v), setattr


def _write_map(msg: Message, name: str, value: dict[Any, Any]) -> None:
    getattr(msg, name).update(value)


def _write_repeated(msg: Message, name: str, value: Any) -> None:
    getattr(msg, name).extend(value)


def _write_repeated_messages(msg: Message, name: str, value: Any) -> None:
    container = getattr(msg, name)
    for item in value:
        _fill(container.add(), item)


def _write_message(msg: Message, name: str, value: Any) -> None:
    sub = getattr(msg, name)
    sub.SetInParent()  # present even when every field keeps its default
    _fill(sub, value)


def _is_repeated(fd: Any) -> bool:
    return bool(fd.is_repeated)


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


# The pairs the services exchange, for callers that want them by name.
PAIRS: list[tuple[type, type[Message]]] = [
    (dt.SamplingParams, engine_pb2.SamplingParams),
    (dt.TensorHandle, tensor_pb2.TensorHandle),
    (dt.MultiModalInput, engine_pb2.MultiModalInput),
    (dt.EngineCoreRequest, engine_pb2.EngineCoreRequest),
    (dt.EngineCoreOutput, engine_pb2.EngineCoreOutput),
    (step_types.SchedulerOutput, worker_pb2.SchedulerOutput),
    (step_types.ModelRunnerOutput, worker_pb2.ModelRunnerOutput),
    (step_types.ModelInfo, worker_pb2.ModelInfo),
    (step_types.KVCacheSpec, worker_pb2.KVCacheSpec),
    (step_types.ServerInfo, engine_pb2.ServerInfo),
    (step_types.SchedulerStats, engine_pb2.SchedulerStats),
]
