"""Protobuf <-> domain conversion.

Every domain dataclass in services.types / services.step_types has the same
field names as its protobuf message, so one generic pair of functions covers
them all: `to_proto(obj, MessageClass)` and `from_proto(msg, DataclassType)`.

Conversion sits on the per-step path (SchedulerOutput and ModelRunnerOutput
cross it four times a step, every streamed update once), so for each
(dataclass, message) pair a straight-line function is generated once from the
field descriptors and cached, the way `dataclasses` generates `__init__`. For
CachedRequestData the generated decoder reads, in effect:

    def decode(msg):
        return cls(msg.request_id, list(msg.new_block_ids), msg.num_computed_tokens)

Rules: a None domain value leaves the proto field unset; an unset optional
scalar whose hint admits None decodes to None (presence is the meaning: unset
`max_tokens` is "up to max_model_len", whatever the dataclass default); any other
unset proto field with presence (messages, oneof members) takes the dataclass
default; repeated fields become lists (tuples where the hint says tuple); enum
fields become the hinted enum; nested messages and lists of them recurse.
"""

from __future__ import annotations

import dataclasses
import enum
import keyword
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from services import step_types
from services import types as dt
from services.pb import engine_pb2, tensor_pb2, worker_pb2

T = TypeVar("T")
M = TypeVar("M", bound=Message)

Encoder = Callable[[Message, Any], None]  # fills a message in place from a dataclass
Decoder = Callable[[Message], Any]  # builds a dataclass from a message


def to_proto(obj: Any, message_cls: type[M]) -> M:
    """Build a `message_cls` from a domain dataclass with the same field names."""
    msg = message_cls()
    _encoder(type(obj), message_cls)(msg, obj)
    return msg


def fill_proto(msg: M, obj: Any) -> M:
    """Fill an existing message (e.g. `repeated.add()`, which avoids a copy) from `obj`."""
    _encoder(type(obj), type(msg))(msg, obj)
    return msg


def from_proto(msg: Message, cls: type[T]) -> T:
    """Build a domain dataclass `cls` from a message with the same field names."""
    return _decoder(cls, type(msg))(msg)


_ENCODERS: dict[tuple[type, type], Encoder] = {}
_DECODERS: dict[tuple[type, type], Decoder] = {}
_PLAIN = (int, float, str, bool, bytes)  # map keys / values that need no conversion


def _encoder(cls: type, message_cls: type[Message]) -> Encoder:
    fn = _ENCODERS.get((cls, message_cls))
    if fn is None:
        fn = _ENCODERS[(cls, message_cls)] = _compile_encoder(cls, message_cls)
    return fn


def _decoder(cls: type, message_cls: type[Message]) -> Decoder:
    fn = _DECODERS.get((cls, message_cls))
    if fn is None:
        fn = _DECODERS[(cls, message_cls)] = _compile_decoder(cls, message_cls)
    return fn


# ---- code generation ------------------------------------------------------------


def _fields(cls: type, message_cls: type[Message]) -> list[tuple[str, Any, Any]]:
    """(name, hint without Optional, field descriptor) per dataclass field, in init order."""
    hints = typing.get_type_hints(cls)
    by_name = message_cls.DESCRIPTOR.fields_by_name
    out = []
    for f in dataclasses.fields(cls):
        fd = by_name.get(f.name)
        if fd is None:
            raise TypeError(f"{message_cls.__name__} has no field {f.name!r} ({cls.__name__})")
        if f.kw_only or not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: only positional init fields convert")
        out.append((f.name, _strip_optional(hints[f.name]), fd))
    return out


def _compile_decoder(cls: type, message_cls: type[Message]) -> Decoder:
    ns: dict[str, Any] = {"cls": cls}
    args = []
    for i, ((name, hint, fd), f) in enumerate(
        zip(_fields(cls, message_cls), dataclasses.fields(cls), strict=True)
    ):
        expr = _read_expr(i, _get("msg", name), hint, fd, ns)
        if fd.has_presence and not fd.is_repeated:
            ns[f"d{i}"] = _unset_value(cls, f, fd)
            expr = f"({expr} if msg.HasField({name!r}) else d{i}())"
        args.append(expr)
    src = f"def decode(msg):\n    return cls({', '.join(args)})\n"
    return _exec(src, ns, "decode")


def _read_expr(i: int, value: str, hint: Any, fd: Any, ns: dict[str, Any]) -> str:
    """A Python expression turning the proto value `value` into the domain value."""
    origin = typing.get_origin(hint)
    if origin is dict:
        key_t, val_t = typing.get_args(hint)
        if key_t in _PLAIN and val_t in _PLAIN:
            return f"dict({value})"
        ns[f"k{i}"], ns[f"v{i}"] = key_t, val_t
        return f"{{k{i}(k): v{i}(v) for k, v in {value}.items()}}"
    if fd.is_repeated:
        (item_t, *_) = typing.get_args(hint) or (Any,)
        if fd.message_type is not None:
            ns[f"s{i}"] = _decoder(item_t, GetMessageClass(fd.message_type))
            return f"(list(map(s{i}, x{i})) if (x{i} := {value}) else [])"
        return f"tuple({value})" if origin is tuple else f"{value}[:]"  # a slice is a list
    if fd.message_type is not None:
        ns[f"s{i}"] = _decoder(hint, GetMessageClass(fd.message_type))
        return f"s{i}({value})"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        ns[f"e{i}"] = hint
        return f"e{i}({value})"
    return value


def _compile_encoder(cls: type, message_cls: type[Message]) -> Encoder:
    ns: dict[str, Any] = {}
    lines = ["def encode(msg, obj):"]
    for i, (name, hint, fd) in enumerate(_fields(cls, message_cls)):
        lines.append(f"    v = {_get('obj', name)}")
        lines += [f"    {line}" for line in _write_lines(i, name, hint, fd, ns)]
    return _exec("\n".join(lines) + "\n", ns, "encode")


def _write_lines(i: int, name: str, hint: Any, fd: Any, ns: dict[str, Any]) -> list[str]:
    """Statements writing the domain value `v` into field `name` of `msg`."""
    field = _get("msg", name)
    if typing.get_origin(hint) is dict:
        return [f"if v: {field}.update(v)"]
    if fd.is_repeated and fd.message_type is not None:
        (item_t, *_) = typing.get_args(hint) or (Any,)
        ns[f"s{i}"] = _nested_encoder(item_t, GetMessageClass(fd.message_type))
        return [
            "if v:",
            f"    add = {field}.add",
            "    for item in v:",
            f"        s{i}(add(), item)",
        ]
    if fd.is_repeated:
        return [f"if v: {field}.extend(v)"]
    if fd.message_type is not None:
        ns[f"s{i}"] = _nested_encoder(hint, GetMessageClass(fd.message_type))
        return [
            "if v is not None:",
            f"    sub = {field}",
            "    sub.SetInParent()",
            f"    s{i}(sub, v)",
        ]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return [f"if v is not None: {_set('msg', name, 'int(v)')}"]
    return [f"if v is not None: {_set('msg', name, 'v')}"]


def _nested_encoder(hint: Any, message_cls: type[Message]) -> Encoder:
    """The compiled encoder for a dataclass hint; else one that looks at each value's type."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _encoder(hint, message_cls)
    return lambda msg, obj: _encoder(type(obj), message_cls)(msg, obj)


def _unset_value(cls: type, f: dataclasses.Field[Any], fd: Any) -> Callable[[], Any]:
    """What an unset field with presence decodes to: None for an optional scalar whose hint
    admits None, else the dataclass default."""
    hint = typing.get_type_hints(cls)[f.name]
    if fd.message_type is None and hint is not _strip_optional(hint):
        return lambda: None
    return _default_thunk(cls, f)


def _default_thunk(cls: type, f: dataclasses.Field[Any]) -> Callable[[], Any]:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory
    if f.default is not dataclasses.MISSING:
        default = f.default
        return lambda: default

    def missing() -> Any:
        raise TypeError(f"{cls.__name__}.{f.name} is required but unset in the message")

    return missing


def _get(var: str, name: str) -> str:
    return f"getattr({var}, {name!r})" if keyword.iskeyword(name) else f"{var}.{name}"


def _set(var: str, name: str, value: str) -> str:
    return (
        f"setattr({var}, {name!r}, {value})"
        if keyword.iskeyword(name)
        else (f"{var}.{name} = {value}")
    )


def _exec(src: str, ns: dict[str, Any], name: str) -> Any:
    exec(compile(src, f"<services.convert {name}>", "exec"), ns)
    return ns[name]


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


# ---- hand-written pairs ------------------------------------------------------------
# StructuredOutputParams is the one message whose shape differs from its dataclass: a
# oneof with `json_schema` (vLLM's domain name is `json`) and `choice` wrapped in a message.


def _encode_structured(msg: Message, obj: dt.StructuredOutputParams) -> None:
    if obj.json is not None:
        msg.json_schema = obj.json  # type: ignore[attr-defined]
    elif obj.json_object:
        msg.json_object = True  # type: ignore[attr-defined]
    elif obj.regex is not None:
        msg.regex = obj.regex  # type: ignore[attr-defined]
    elif obj.choice is not None:
        msg.choice.SetInParent()  # type: ignore[attr-defined]
        msg.choice.values.extend(obj.choice)  # type: ignore[attr-defined]
    elif obj.grammar is not None:
        msg.grammar = obj.grammar  # type: ignore[attr-defined]


def _decode_structured(msg: Message) -> dt.StructuredOutputParams:
    which = msg.WhichOneof("constraint")
    if which is None:
        raise ValueError("StructuredOutputParams has no constraint set")
    if which == "choice":
        return dt.StructuredOutputParams(choice=tuple(msg.choice.values))  # type: ignore[attr-defined]
    value = getattr(msg, which)
    return dt.StructuredOutputParams(**{"json" if which == "json_schema" else which: value})


_ENCODERS[(dt.StructuredOutputParams, engine_pb2.StructuredOutputParams)] = _encode_structured
_DECODERS[(dt.StructuredOutputParams, engine_pb2.StructuredOutputParams)] = _decode_structured


# The pairs the services exchange, for callers that want them by name.
PAIRS: list[tuple[type, type[Message]]] = [
    (dt.SamplingParams, engine_pb2.SamplingParams),
    (dt.StructuredOutputParams, engine_pb2.StructuredOutputParams),
    (dt.TensorHandle, tensor_pb2.TensorHandle),
    (dt.MultiModalInput, engine_pb2.MultiModalInput),
    (dt.LoRARequest, engine_pb2.LoRARequest),
    (dt.EngineCoreRequest, engine_pb2.EngineCoreRequest),
    (dt.EngineCoreOutput, engine_pb2.EngineCoreOutput),
    (step_types.SchedulerOutput, worker_pb2.SchedulerOutput),
    (step_types.ModelRunnerOutput, worker_pb2.ModelRunnerOutput),
    (step_types.ModelInfo, worker_pb2.ModelInfo),
    (step_types.KVCacheSpec, worker_pb2.KVCacheSpec),
    (step_types.ServerInfo, engine_pb2.ServerInfo),
    (step_types.SchedulerStats, engine_pb2.SchedulerStats),
]
