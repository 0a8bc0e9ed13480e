"""Typed, range-checked reads from a decoded JSON object, with clear 400 errors.

JSON `null` counts as absent; unknown keys are ignored; booleans are never
accepted where numbers are expected.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from gateway.errors import InvalidRequest

T = TypeVar("T")
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be a UTF-8 JSON object."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"the body must be a JSON object, not {json_type(data)}")
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


class Fields:
    """Reads fields of one JSON object; `prefix` names nested objects in messages."""

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix

    def raw(self, name: str) -> Any:
        return self.data.get(name)

    def error(self, name: str, message: str) -> InvalidRequest:
        return InvalidRequest(f"'{self.prefix}{name}' {message}", param=self.prefix + name)

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(name, f"must be a string, not {json_type(value)}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"must be a boolean, not {json_type(value)}")
        return value

    def integer(
        self, name: str, default: int | None, lo: int = -INT64_MAX - 1, hi: int = INT64_MAX
    ) -> int | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, not {json_type(value)}")
        if not lo <= value <= hi:
            raise self.error(name, f"must be in [{lo}, {hi}], got {value}")
        return value

    def number(
        self, name: str, default: float | None, lo: float, hi: float, lo_open: bool = False
    ) -> float | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(name, f"must be a number, not {json_type(value)}")
        value = float(value)
        low_ok = value > lo if lo_open else value >= lo
        if not (math.isfinite(value) and low_ok and value <= hi):
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise self.error(name, f"must be in {interval}, got {value:g}")
        return value

    def array(self, name: str, max_items: int = 100_000) -> list[Any] | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self.error(name, f"must be an array, not {json_type(value)}")
        if len(value) > max_items:
            raise self.error(name, f"may hold at most {max_items} items, got {len(value)}")
        return value

    def obj(self, name: str) -> dict[str, Any] | None:
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(name, f"must be an object, not {json_type(value)}")
        return value

    def int_list(self, name: str, lo: int = 0, hi: int = INT32_MAX) -> list[int] | None:
        items = self.array(name)
        if items is None:
            return None
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
                raise self.error(name, f"must hold integers in [{lo}, {hi}], got {item!r:.40}")
        return items
