"""Property: every domain dataclass survives domain -> proto -> bytes -> proto -> domain.

Values are drawn from each field's protobuf type (int32 ranges, float32 for `float`
fields, any text, any bytes...), so the generated conversion code is exercised far
beyond the hand-written cases of tests/foundation/test_convert.py.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services import convert
from services.types import MAX_LOGPROBS, SamplingParams, StructuredOutputParams

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_INTS = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1), FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_UINT64: (0, 2**64 - 1),
}  # fmt: skip
# SamplingParams validates its values: draw inside the documented ranges.
_PARAM_BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0, 4), "top_p": (1e-6, 1), "top_k": (-1, 1000), "min_p": (0, 1),
    "max_tokens": (1, 1 << 20), "min_tokens": (0, 64), "presence_penalty": (-2, 2),
    "frequency_penalty": (-2, 2), "repetition_penalty": (1e-3, 100), "logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS), "stop_token_ids": (0, 2**31 - 1),
}  # fmt: skip


def _scalar(fd: Any, bounds: tuple[float, float] | None) -> st.SearchStrategy[Any]:
    if fd.type in _INTS:
        lo, hi = _INTS[fd.type]
        if bounds:
            lo, hi = max(lo, int(bounds[0])), min(hi, int(bounds[1]))
        return st.integers(lo, hi)
    if fd.type in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        width = 32 if fd.type == FD.TYPE_FLOAT else 64
        lo_hi = {"min_value": bounds[0], "max_value": bounds[1]} if bounds else {}
        return st.floats(allow_nan=False, width=width, **lo_hi)  # type: ignore[arg-type]
    if fd.type == FD.TYPE_BOOL:
        return st.booleans()
    if fd.type == FD.TYPE_STRING:
        return st.text(max_size=20)
    if fd.type == FD.TYPE_BYTES:
        return st.binary(max_size=20)
    raise TypeError(f"no strategy for {fd.full_name}")


def _value(hint: Any, fd: Any, bounds: tuple[float, float] | None) -> st.SearchStrategy[Any]:
    """Values for one field: `hint` is the dataclass type (Optional stripped)."""
    origin = typing.get_origin(hint)
    if origin is dict:
        key_fd, val_fd = (
            fd.message_type.fields_by_name["key"],
            fd.message_type.fields_by_name["value"],
        )
        val_bounds = (-100, 100) if bounds else None  # logit_bias values
        return st.dictionaries(_scalar(key_fd, bounds), _scalar(val_fd, val_bounds), max_size=3)
    if fd.is_repeated:
        (item_t, *_) = typing.get_args(hint) or (Any,)
        item = (
            _dataclass(item_t, GetMessageClass(fd.message_type))
            if fd.message_type is not None
            else _scalar(fd, bounds)
        )
        items = st.lists(item, max_size=3)
        return items.map(tuple) if origin is tuple else items
    if fd.message_type is not None:
        return _dataclass(hint, GetMessageClass(fd.message_type))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from(list(hint))
    return _scalar(fd, bounds)


@st.composite
def _valid(draw: st.DrawFn, cls: type, fields: dict[str, st.SearchStrategy[Any]]) -> Any:
    try:
        return cls(**{name: draw(s) for name, s in fields.items()})
    except ValueError:
        assume(False)  # violates the dataclass's own validation (e.g. min_tokens > max_tokens)


def _structured() -> st.SearchStrategy[StructuredOutputParams]:
    """One constraint of each form (a oneof: the generic strategy would set several)."""
    text = st.text(min_size=1, max_size=20)
    return st.one_of(
        st.builds(StructuredOutputParams, json=text),
        st.just(StructuredOutputParams(json_object=True)),
        st.builds(StructuredOutputParams, regex=text),
        st.builds(StructuredOutputParams, choice=st.lists(text, min_size=1, max_size=3).map(tuple)),
        st.builds(StructuredOutputParams, grammar=text),
    )


def _dataclass(cls: type, message_cls: type[Message]) -> st.SearchStrategy[Any]:
    if cls is StructuredOutputParams:
        return _structured()
    hints = typing.get_type_hints(cls)
    by_name = message_cls.DESCRIPTOR.fields_by_name
    fields = {}
    for f in dataclasses.fields(cls):
        fd, hint = by_name[f.name], hints[f.name]
        bare = _strip_optional(hint)
        bounds = _PARAM_BOUNDS.get(f.name) if cls is SamplingParams else None
        if cls is SamplingParams and f.name == "logit_bias":
            bounds = (0, 2**31 - 1)
        strategy = _value(bare, fd, bounds)
        optional = bare is not hint and not fd.is_repeated
        fields[f.name] = st.none() | strategy if optional else strategy
    return _valid(cls, fields)


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


@SETTINGS
@given(data=st.data())
def test_every_pair_round_trips(data: st.DataObject) -> None:
    cls, message_cls = data.draw(st.sampled_from(convert.PAIRS))
    obj = data.draw(_dataclass(cls, message_cls))
    wire = convert.to_proto(obj, message_cls).SerializeToString()
    back: Any = convert.from_proto(message_cls.FromString(wire), cls)
    assert back == obj


def test_sampling_params_bounds_are_the_dataclass_ranges() -> None:
    """The strategy's ranges must stay valid: the extremes construct."""
    low = {n: b[0] for n, b in _PARAM_BOUNDS.items() if n != "stop_token_ids"}
    high = {n: b[1] for n, b in _PARAM_BOUNDS.items() if n != "stop_token_ids"}
    SamplingParams(**{**low, "max_tokens": 64})  # type: ignore[arg-type]
    SamplingParams(**high)  # type: ignore[arg-type]
