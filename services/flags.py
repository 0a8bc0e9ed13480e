"""One declaration per command-line flag.

A config dataclass field declared with `flag(default, help, ...)` carries its type (the
annotation), its default and its help once; from it `add_flags` adds the argparse argument,
`from_args` builds the dataclass from the parsed namespace, `to_flags` writes a config back as
the flags that reproduce it (how `tessera serve` hands its configs to the services), and
tessera.config_doc documents it. The flag is `--field-name` unless `name` spells it otherwise.

Booleans are switches: giving the flag flips the field's default (`--enable-lora` turns a
False on, `--no-prefix-caching` turns a True off). A field with `parse` reads the flag's text
with it (`--kv-cache-memory 2GiB`) and `show` writes it back; a tuple field takes several
values after one flag (`nargs="*"` or `"+"`) or one value per repeated flag (`"append"`).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

FLAG = "flag"  # the dataclass field metadata key holding its Flag
T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """A flag's declaration: default, help and how its text becomes the field's value."""

    default: Any
    help: str
    name: str = ""  # "--x-y"; empty: from the field name
    short: str = ""  # another spelling, e.g. "-q"
    choices: tuple[Any, ...] | None = None  # empty: a Literal annotation's values, if any
    parse: Callable[[Any], Any] | None = None  # the flag's text (one item of a tuple) -> value
    show: Callable[[Any], str] = str  # a value (one item of a tuple) -> the flag's text
    nargs: str | None = None  # tuple fields: "*", "+" or "append"
    metavar: str | None = None
    required: bool = False

    def field(self) -> Any:
        """The dataclass field this flag declares (share one Flag for the same flag of two
        configs: it is then still declared once)."""
        return dataclasses.field(default=self.default, metadata={FLAG: self})


def flag(default: Any, help: str, **options: Any) -> Any:
    """A dataclass field that is also a command-line flag (see Flag)."""
    return Flag(default, help, **options).field()


def flag_name(f: dataclasses.Field[Any]) -> str:
    spec: Flag = f.metadata[FLAG]
    return spec.name or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field[Any]) -> str:
    return flag_name(f).lstrip("-").replace("-", "_")


def flag_fields(cls: type) -> Iterator[dataclasses.Field[Any]]:
    """The fields of `cls` that are flags (not those of its nested configs)."""
    return (f for f in dataclasses.fields(cls) if FLAG in f.metadata)


def nested(f: dataclasses.Field[Any]) -> type | None:
    """The config class a field holds whole (`hub: HubConfig = field(default_factory=...)`)."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def _choices(cls: type, f: dataclasses.Field[Any], spec: Flag) -> tuple[Any, ...] | None:
    if spec.choices is not None:
        return spec.choices
    hint = typing.get_type_hints(cls).get(f.name)
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def _cli_default(spec: Flag) -> Any:
    """The namespace value when the flag is not given (its text, as a user would write it)."""
    if isinstance(spec.default, bool):
        return False  # a switch: given flips the field's default
    if spec.nargs == "append":
        return None  # argparse appends to a given default
    if spec.nargs:
        return [spec.show(item) for item in spec.default]
    return spec.show(spec.default) if spec.parse and spec.default is not None else spec.default


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    only: Sequence[str] = (),
    skip: Sequence[str] = (),
) -> None:
    """The flags of `cls`'s fields (`only` these, none of `skip`, by field name); a flag the
    parser already has (the same Flag shared by two configs) is added once."""
    for f in flag_fields(cls):
        name, spec = flag_name(f), f.metadata[FLAG]
        if (only and f.name not in only) or f.name in skip:
            continue
        if name in parser._option_string_actions:
            continue
        options: dict[str, Any] = {"help": spec.help, "default": _cli_default(spec)}
        if isinstance(spec.default, bool):
            options["action"] = "store_true"
        else:
            if spec.nargs == "append":
                options["action"] = "append"
            elif spec.nargs:
                options["nargs"] = spec.nargs
            if spec.parse is None and type(spec.default) in (int, float):
                options["type"] = type(spec.default)
            options["choices"] = _choices(cls, f, spec)
            options["metavar"] = spec.metavar
            options["required"] = spec.required
        action = parser.add_argument(*filter(None, (name, spec.short)), **options)
        action.declaration = spec  # type: ignore[attr-defined]


def _value(spec: Flag, raw: Any) -> Any:
    if isinstance(spec.default, bool):
        return spec.default != raw
    if spec.nargs:
        if raw is None:
            return spec.default
        return tuple(spec.parse(item) if spec.parse else item for item in raw)
    return spec.parse(raw) if spec.parse else raw


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """A `cls` from the parsed flags: each flag field the parser took (flags it lacks keep
    their defaults), nested configs likewise, `given` as given (ValueError on bad values)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cast(Any, cls)):
        inner = nested(f)
        if f.name in given:
            values[f.name] = given[f.name]
        elif inner is not None:
            values[f.name] = from_args(inner, args)
        elif FLAG in f.metadata and hasattr(args, _dest(f)):
            values[f.name] = _value(f.metadata[FLAG], getattr(args, _dest(f)))
    return cls(**values)


def to_flags(config: Any, skip: Sequence[str] = (), only: Sequence[str] = ()) -> list[str]:
    """The flags that give a service `config` (and its nested configs): those whose value
    differs from the default, which the service has too (same declaration). `skip` / `only`:
    the fields (by name) left out / kept, e.g. to match what the receiving service takes."""
    out: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if nested(f) is not None:
            out += to_flags(value, skip, only)
        elif f.name in skip or (only and f.name not in only):
            continue
        elif FLAG in f.metadata and value != f.default:
            out += _spelled(flag_name(f), f.metadata[FLAG], value)
    return out


def _spelled(name: str, spec: Flag, value: Any) -> list[str]:
    if isinstance(spec.default, bool):
        return [name]
    if spec.nargs == "append":
        return [text for item in value for text in (name, spec.show(item))]
    if spec.nargs:
        return [name, *map(spec.show, value)]
    return [name, spec.show(value)]
