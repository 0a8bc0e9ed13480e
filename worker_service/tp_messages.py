"""Rank 0's commands to the other tensor-parallel ranks, as tensors: no Python objects cross ranks.

Every command is a fixed int64 header [MAGIC, command, a, b] broadcast over the CPU group:
memory (the KV memory handshake), cache (a = the number of KV blocks), stop, and step,
which is followed by one uint8 payload of b bytes: a JSON description (a bytes long) of the
step's inputs, then their bytes, each tensor at the offset the description gives. The
description names every field of the step (input_ids, positions and each AttentionMetadata
field) with its kind: a tensor (dtype, shape, offset), an int, or a list of ints.
A receiver checks all of it against what it expects (magic, command, sizes, field names
and kinds, dtypes from a fixed list) and raises ProtocolError on anything else; a peer can
at worst send wrong numbers.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import typing
from dataclasses import fields
from typing import Any

import torch

from services.config import WorkerConfig
from worker_service.attention.base import AttentionMetadata

MAGIC = 0x7E55_E7A0_0001  # "tessera", wire version 1
HEADER_LEN = 4
MAX_PAYLOAD_BYTES = 1 << 30  # a step's inputs are a few MB at most (block tables included)
DTYPES = {
    name: getattr(torch, name)
    for name in ("int32", "int64", "float32", "float16", "bfloat16", "uint8", "bool")
}
STEP_TENSORS = ("input_ids", "positions")  # with the AttentionMetadata fields


class Command(enum.IntEnum):
    MEMORY = 1
    CACHE = 2
    STEP = 3
    STOP = 4


class ProtocolError(RuntimeError):
    """A message from rank 0 that is not one this rank understands."""


def _kinds() -> dict[str, str]:
    """Each step field and its kind: tensor, int or ints (from AttentionMetadata's hints)."""
    hints = typing.get_type_hints(AttentionMetadata)
    kinds = dict.fromkeys(STEP_TENSORS, "tensor")
    by_hint = {torch.Tensor: "tensor", int: "int", list[int]: "ints"}
    for f in fields(AttentionMetadata):
        if hints[f.name] not in by_hint:
            raise TypeError(f"AttentionMetadata.{f.name}: no wire encoding for {hints[f.name]}")
        kinds[f.name] = by_hint[hints[f.name]]
    return kinds


STEP_FIELDS = _kinds()


def header(command: Command, a: int = 0, b: int = 0) -> torch.Tensor:
    return torch.tensor([MAGIC, int(command), a, b], dtype=torch.int64)


def read_header(h: torch.Tensor) -> tuple[Command, int, int]:
    """(command, a, b) of a received header; ProtocolError unless well formed."""
    magic, code, a, b = (int(x) for x in h.tolist())
    if magic != MAGIC:
        raise ProtocolError(f"tensor parallel message with a bad magic number {magic:#x}")
    try:
        command = Command(code)
    except ValueError:
        raise ProtocolError(f"unknown tensor parallel command {code}") from None
    if command == Command.CACHE and a < 1:
        raise ProtocolError(f"cache command with {a} blocks")
    if command == Command.STEP and not 0 < a <= b <= MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"step payload of {b} bytes with a {a}-byte description")
    return command, a, b


# ---------------------------------------------------------------------- steps
def encode_step(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> tuple[int, torch.Tensor]:
    """(description length, payload) of a step: host tensors, no Python objects."""
    values = {"input_ids": input_ids, "positions": positions}
    values.update({f.name: getattr(meta, f.name) for f in fields(meta)})
    described: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, kind in STEP_FIELDS.items():
        value = values[name]
        if kind != "tensor":
            described[name] = int(value) if kind == "int" else [int(v) for v in value]
            continue
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        dtype = str(value.dtype).removeprefix("torch.")
        described[name] = {"dtype": dtype, "shape": list(value.shape), "offset": offset}
        chunks.append(data.numpy().tobytes())
        offset += data.numel()
    text = json.dumps(described, separators=(",", ":")).encode()
    # joined as bytes: torch.cat of uint8 runs on the intra-op pool (4.6 ms vs 38 us for
    # a 256-request step on a busy 2-core host)
    payload = bytearray(b"".join([text, *chunks]))
    return len(text), torch.frombuffer(payload, dtype=torch.uint8)


def decode_step(
    payload: torch.Tensor, text_len: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, meta) from a step payload; ProtocolError unless it is exactly
    the fields encode_step writes, each of its kind, within the payload."""
    buffer = bytearray(payload.numpy().data)  # one copy; the tensors view it
    try:
        described = json.loads(buffer[:text_len])
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("step description is not JSON") from None
    if not isinstance(described, dict) or set(described) != set(STEP_FIELDS):
        got = sorted(described) if isinstance(described, dict) else type(described).__name__
        raise ProtocolError(f"step fields {got} are not {sorted(STEP_FIELDS)}")
    values = {
        name: _field(name, STEP_FIELDS[name], described[name], buffer, text_len)
        for name in described
    }
    ids, positions = values.pop("input_ids"), values.pop("positions")
    return ids, positions, AttentionMetadata(**values)


def _field(name: str, kind: str, value: Any, buffer: bytearray, start: int) -> Any:
    if kind == "int":
        if type(value) is not int:
            raise ProtocolError(f"step field {name} must be an int")
        return value
    if kind == "ints":
        if not isinstance(value, list) or any(type(v) is not int for v in value):
            raise ProtocolError(f"step field {name} must be a list of ints")
        return value
    return _tensor(name, value, buffer, start)


def _tensor(name: str, spec: Any, buffer: bytearray, start: int) -> torch.Tensor:
    """The tensor `spec` describes, viewing its bytes at start + offset in `buffer`."""
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "offset"}:
        raise ProtocolError(f"step field {name}: a tensor needs dtype, shape and offset")
    dtype, shape, offset = DTYPES.get(spec["dtype"]), spec["shape"], spec["offset"]
    if dtype is None:
        raise ProtocolError(f"step field {name}: unsupported dtype {spec['dtype']!r}")
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise ProtocolError(f"step field {name}: bad shape {shape!r}")
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if type(offset) is not int or offset < 0 or start + offset + nbytes > len(buffer):
        raise ProtocolError(f"step field {name}: {nbytes} bytes at {offset} overrun the payload")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=start + offset)
    return flat.reshape(shape)


# ------------------------------------------------------- the config of a started rank
def encode_config(config: WorkerConfig) -> bytes:
    """A WorkerConfig as JSON (what rank 0 writes to the stdin of a rank it starts)."""
    return json.dumps(dataclasses.asdict(config)).encode()


def decode_config(data: bytes) -> WorkerConfig:
    """The WorkerConfig encode_config wrote, validated again by its constructors."""
    config = _build(WorkerConfig, json.loads(data))
    assert isinstance(config, WorkerConfig)
    return config


def _build(cls: type, values: Any) -> Any:
    """`cls(**values)`, nested config dataclasses rebuilt the same way; ValueError for a
    field `cls` does not have."""
    if not isinstance(values, dict):
        raise ValueError(f"{cls.__name__} must be a JSON object")
    hints = typing.get_type_hints(cls)
    unknown = set(values) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {sorted(unknown)}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            value = _build(typing.cast(type, hint), value)
        elif typing.get_origin(hint) is tuple:
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)
