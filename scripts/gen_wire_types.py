"""Generate services/wire.py, the domain dataclasses of the wire messages, from protos/.

For each message reachable from ROOTS it writes one dataclass (fields in proto order, types
and defaults from the descriptor and protos/options.proto) and a straight-line pair of
converters, `_fill_x(msg, obj)` and `_read_x(msg) -> X`. Behaviour (validation, properties)
comes from services/wire_rules.py: class `X` inherits `XRules` when that module defines it.

Rules: an unset field decodes to its Python default, so `Message()` decodes to `X()` (but
a field marked unset_is_none, SamplingParams.max_tokens, decodes to None); a None value
leaves a field unset; repeated fields are lists (tuples with the `tuple` option);
enums become the generated IntEnum. Run by scripts/gen_protos.sh after the stubs;
`--check` exits 1 when services/wire.py is stale.
"""

from __future__ import annotations

import ast
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc_tools
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from grpc_tools import protoc

from services.pb import engine_pb2, options_pb2, worker_pb2

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "services" / "wire.py"
RULES = ROOT / "services" / "wire_rules.py"

# The messages services exchange as dataclasses; what they contain comes along.
ROOTS: list[Any] = [
    engine_pb2.EngineCoreRequest,
    engine_pb2.EngineCoreOutput,
    engine_pb2.ServerInfo,
    engine_pb2.SchedulerStats,
    worker_pb2.SchedulerOutput,
    worker_pb2.ModelRunnerOutput,
    worker_pb2.ModelInfo,
    worker_pb2.KVCacheSpec,
]

F = FieldDescriptor
LINE = 100  # ruff's line length: the output needs no formatting
INT_TYPES = {F.CPPTYPE_INT32, F.CPPTYPE_INT64, F.CPPTYPE_UINT32, F.CPPTYPE_UINT64}
FLOAT_TYPES = {F.CPPTYPE_DOUBLE, F.CPPTYPE_FLOAT}

HEADER = '''"""Domain types of the wire messages and their converters.

Generated from protos/ by scripts/gen_wire_types.py (`make proto`); do not edit. Fields,
types and defaults come from the .proto files (defaults: protos/options.proto), behaviour
from services/wire_rules.py. Import the types from services.types / services.step_types and
convert with services.convert.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import Message

from services import wire_rules as rules
from services.pb import engine_pb2, tensor_pb2, worker_pb2

M = TypeVar("M", bound=Message)
T = TypeVar("T")


def _fill_each(
    messages: RepeatedCompositeFieldContainer[M], items: Iterable[T], fill: Callable[[M, T], None]
) -> None:
    add = messages.add
    for item in items:
        fill(add(), item)
'''


@dataclass(frozen=True)
class Field:
    name: str
    hint: str
    default: str | None  # source of the default; None: required
    fill: list[str]  # statements writing obj.<name> into msg
    read: str  # expression reading msg.<name>


def snake(name: str) -> str:
    return re.sub(r"(?<=[A-Za-z0-9])(?=[A-Z][a-z])", "_", name).lower()  # LoRARequest: lora_request


def module(desc: Descriptor | EnumDescriptor) -> str:
    return desc.file.name.removesuffix(".proto") + "_pb2"


def comments() -> dict[str, str]:
    """The comment above each top-level message and enum of protos/, by full name."""
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "protos.pb"
        args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", "--include_source_info"]
        protos = [str(p) for p in sorted((ROOT / "protos").glob("*.proto"))]
        if protoc.main([*args, f"--descriptor_set_out={out}", *protos]) != 0:
            raise SystemExit("protoc failed")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    found = {}
    for f in files:
        text = {tuple(loc.path): loc.leading_comments for loc in f.source_code_info.location}
        # 4 and 5: FileDescriptorProto's message_type and enum_type fields
        names = [(4, i, m.name) for i, m in enumerate(f.message_type)]
        names += [(5, i, e.name) for i, e in enumerate(f.enum_type)]
        for kind, i, name in names:
            found[f"{f.package}.{name}"] = text.get((kind, i), "")
    return found


def docstring(full_name: str, file: str, comment: str) -> Iterator[str]:
    """The proto comment as the docstring, then where it comes from."""
    lines = [line.strip() for line in comment.strip().splitlines()]
    lines += ["", f"{full_name} in protos/{file}."] if lines else [f"{full_name} in protos/{file}."]
    text = '"""' + "\n".join(lines) + '"""'
    yield from (f"    {line}" if line else "" for line in text.splitlines())


def messages() -> list[Descriptor]:
    """Every message reachable from ROOTS, each after the messages it contains."""
    seen: dict[str, Descriptor] = {}

    def visit(desc: Descriptor) -> None:
        if desc.name in seen:
            return
        for fd in desc.fields:
            nested = fd.message_type
            carried = nested is not None and option(fd, options_pb2.unwrap)  # not a type
            if nested is not None and not nested.GetOptions().map_entry and not carried:
                visit(nested)
        seen[desc.name] = desc

    for cls in ROOTS:
        visit(cls.DESCRIPTOR)
    return list(seen.values())


def enums(descs: list[Descriptor]) -> list[EnumDescriptor]:
    found = {fd.enum_type.full_name: fd.enum_type for d in descs for fd in d.fields if fd.enum_type}
    return list(found.values())


def scalar_type(fd: FieldDescriptor) -> str:
    if fd.cpp_type in INT_TYPES:
        return "int"
    if fd.cpp_type in FLOAT_TYPES:
        return "float"
    if fd.cpp_type == F.CPPTYPE_BOOL:
        return "bool"
    return "bytes" if fd.type == F.TYPE_BYTES else "str"


def parse_default(fd: FieldDescriptor, text: str) -> str:
    """The Python source of a default given as text in the (tessera.v1.default) option."""
    kind = scalar_type(fd)
    if kind == "bool":
        return {"true": "True", "false": "False"}[text]
    if kind == "str":
        return f'"{text}"'
    return repr({"int": int, "float": float}[kind](text))


def option(fd: FieldDescriptor, ext: Any) -> Any:
    return fd.GetOptions().Extensions[ext]


def plan(fd: FieldDescriptor) -> Field:
    """How one field is declared, written and read; a required one has no default."""
    f = plan_optional(fd)
    return replace(f, default=None) if option(fd, options_pb2.required) else f


def plan_optional(fd: FieldDescriptor) -> Field:
    name, default_text = fd.name, option(fd, options_pb2.default)
    msg_type, get = fd.message_type, f"msg.{name}"
    if msg_type is not None and msg_type.GetOptions().map_entry:
        k, v = (scalar_type(f) for f in msg_type.fields)
        fill = [f"if obj.{name}:", f"    msg.{name}.update(obj.{name})"]
        return Field(name, f"dict[{k}, {v}]", "field(default_factory=dict)", fill, f"dict({get})")
    if fd.is_repeated and msg_type is not None:
        item = msg_type.name
        fill = [f"if obj.{name}:", f"    _fill_each(msg.{name}, obj.{name}, _fill_{snake(item)})"]
        read = f"list(map(_read_{snake(item)}, {get})) if {get} else []"
        return Field(name, f"list[{item}]", "field(default_factory=list)", fill, read)
    if fd.is_repeated:
        fill, t = [f"if obj.{name}:", f"    msg.{name}.extend(obj.{name})"], scalar_type(fd)
        if option(fd, options_pb2.tuple):
            return Field(name, f"tuple[{t}, ...]", "()", fill, f"tuple({get})")
        return Field(name, f"list[{t}]", "field(default_factory=list)", fill, f"{get}[:]")
    if msg_type is not None:
        return message_field(fd)
    if fd.enum_type is not None:
        enum_name, zero = fd.enum_type.name, enum_members(fd.enum_type)[0][0]
        fill = [f"msg.{name} = {module(fd.enum_type)}.{enum_name}.ValueType(obj.{name})"]
        return Field(name, enum_name, f"{enum_name}.{zero}", fill, f"{enum_name}({get})")
    return scalar_field(fd, default_text)


def message_field(fd: FieldDescriptor) -> Field:
    assert fd.message_type is not None
    name, item = fd.name, fd.message_type.name
    if option(fd, options_pb2.unwrap):
        return unwrapped_field(fd)
    fill_fn, read_fn = f"_fill_{snake(item)}", f"_read_{snake(item)}"
    if option(fd, options_pb2.never_none):
        return Field(
            name,
            item,
            f"field(default_factory={item})",
            [f"{fill_fn}(msg.{name}, obj.{name})"],
            f"{read_fn}(msg.{name})",
        )
    fill = [
        f"if obj.{name} is not None:",
        f"    msg.{name}.SetInParent()",
        f"    {fill_fn}(msg.{name}, obj.{name})",
    ]
    read = f'{read_fn}(msg.{name}) if msg.HasField("{name}") else None'
    return Field(name, f"{item} | None", "None", fill, read)


def unwrapped_field(fd: FieldDescriptor) -> Field:
    """A message field carrying one repeated scalar, as the tuple of its values or None."""
    assert fd.message_type is not None
    (inner,) = fd.message_type.fields
    if not inner.is_repeated or inner.message_type is not None:
        raise SystemExit(f"{fd.full_name}: unwrap needs a message of one repeated scalar")
    name, values, t = fd.name, inner.name, scalar_type(inner)
    fill = [
        f"if obj.{name} is not None:",
        f"    msg.{name}.SetInParent()",
        f"    msg.{name}.{values}.extend(obj.{name})",
    ]
    read = f'tuple(msg.{name}.{values}) if msg.HasField("{name}") else None'
    return Field(name, f"tuple[{t}, ...] | None", "None", fill, read)


def scalar_field(fd: FieldDescriptor, default_text: str) -> Field:
    name, t = fd.name, scalar_type(fd)
    has = f'msg.HasField("{name}")'
    default = parse_default(fd, default_text) if default_text else None
    if not fd.has_presence:
        if default is not None:
            raise SystemExit(f"{fd.full_name}: a non-zero default needs `optional`")
        zero = {"int": "0", "float": "0.0", "bool": "False", "str": '""', "bytes": 'b""'}[t]
        return Field(name, t, zero, [f"msg.{name} = obj.{name}"], f"msg.{name}")
    if default is not None and not option(fd, options_pb2.unset_is_none):
        read = f"msg.{name} if {has} else {default}"
        return Field(name, t, default, [f"msg.{name} = obj.{name}"], read)
    fill = [f"if obj.{name} is not None:", f"    msg.{name} = obj.{name}"]
    return Field(name, f"{t} | None", default or "None", fill, f"msg.{name} if {has} else None")


def enum_members(desc: EnumDescriptor) -> list[tuple[str, int]]:
    prefix = snake(desc.name).upper() + "_"
    return [(v.name.removeprefix(prefix), v.number) for v in desc.values]


def render_enum(desc: EnumDescriptor, rules: set[str], doc: str) -> Iterator[str]:
    bases = ([f"rules.{desc.name}Rules"] if f"{desc.name}Rules" in rules else []) + ["enum.IntEnum"]
    yield f"class {desc.name}({', '.join(bases)}):"
    yield from docstring(desc.full_name, desc.file.name, doc)
    yield ""
    for member, number in enum_members(desc):
        yield f"    {member} = {number}"


def render_class(desc: Descriptor, fields: list[Field], rules: set[str], doc: str) -> Iterator[str]:
    frozen = "frozen=True, " if desc.GetOptions().Extensions[options_pb2.frozen] else ""
    base = f"(rules.{desc.name}Rules)" if f"{desc.name}Rules" in rules else ""
    yield f"@dataclass({frozen}slots=True)"
    yield f"class {desc.name}{base}:"
    yield from docstring(desc.full_name, desc.file.name, doc)
    yield ""
    for f in fields:
        yield f"    {f.name}: {f.hint}" + ("" if f.default is None else f" = {f.default}")


def render_converters(desc: Descriptor, fields: list[Field]) -> Iterator[str]:
    cls, fn, pb = desc.name, snake(desc.name), f"{module(desc)}.{desc.name}"
    yield from wrap_def(f"_fill_{fn}", f"msg: {pb}, obj: {cls}", "None")
    for f in fields:
        for line in f.fill:
            yield from wrap_call(f"    {line}")
    yield ""
    yield ""
    yield from wrap_def(f"_read_{fn}", f"msg: {pb}", cls)
    yield f"    return {cls}(  # the fields in order"
    for f in fields:
        yield from wrap_arg(f"{f.read},", "        ")
    yield "    )"


def wrap_def(name: str, params: str, returns: str) -> Iterator[str]:
    """A def line, wrapped the way ruff format wraps it."""
    line = f"def {name}({params}) -> {returns}:"
    comma = "" if ", " in params else ","  # ruff gives a lone parameter a trailing comma
    yield line if len(line) <= LINE else f"def {name}(\n    {params}{comma}\n) -> {returns}:"


def wrap_call(line: str) -> Iterator[str]:
    """A call statement; one too long for a line gets its arguments on a line of their own."""
    if len(line) <= LINE or not line.endswith(")"):
        yield line
        return
    head, args = line[:-1].split("(", 1)
    indent = head[: len(head) - len(head.lstrip())]
    yield from (f"{head}(", f"{indent}    {args}", f"{indent})")


def wrap_arg(arg: str, indent: str) -> Iterator[str]:
    """An argument, wrapped the way ruff format wraps one too long for a line."""
    if len(indent + arg) <= LINE:
        yield indent + arg
        return
    if " if " not in arg:  # a call: its arguments on a line of their own
        head, inner = arg.split("(", 1)
        yield from (f"{indent}{head}(", f"{indent}    {inner[:-2]}", f"{indent}),")
        return
    value, rest = arg.split(" if ", 1)
    test, other = rest.rsplit(" else ", 1)
    yield from (indent + value, f"{indent}if {test}", f"{indent}else {other}")


def render() -> str:
    rules = {n.name for n in ast.parse(RULES.read_text()).body if isinstance(n, ast.ClassDef)}
    descs = messages()
    plans = {d.name: [plan(fd) for fd in d.fields] for d in descs}
    docs = comments()
    blocks = [list(render_enum(e, rules, docs[e.full_name])) for e in enums(descs)]
    blocks += [list(render_class(d, plans[d.name], rules, docs[d.full_name])) for d in descs]
    blocks += [list(render_converters(d, plans[d.name])) for d in descs]
    pairs = [(d.name, f"{module(d)}.{d.name}", snake(d.name)) for d in descs]
    table = ["# Each type's message and converters, for services.convert."]
    table.append("MESSAGES: dict[type, type[Message]] = {")
    table += [f"    {c}: {pb}," for c, pb, _ in pairs]
    table.append("}")
    table.append("FILL: dict[type, Callable[[Any, Any], None]] = {")
    table += [f"    {c}: _fill_{fn}," for c, _, fn in pairs]
    table.append("}")
    table.append("READ: dict[type, Callable[[Any], Any]] = {")
    table += [f"    {c}: _read_{fn}," for c, _, fn in pairs]
    table.append("}")
    blocks.append(table)
    return HEADER + "".join("\n\n" + "\n".join(b) + "\n" for b in blocks)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print("services/wire.py is stale: run scripts/gen_wire_types.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
