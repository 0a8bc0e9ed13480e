"""Stop strings across arbitrary delta boundaries."""

from __future__ import annotations

import pytest

from gateway.stop import StopStringMatcher


def run(stop: list[str], deltas: list[str], include: bool = False) -> tuple[list[str], str | None]:
    m = StopStringMatcher(stop, include)
    out = [m.feed(d) for d in deltas]
    out.append(m.flush())
    return out, m.matched


@pytest.mark.parametrize("cut", range(1, 12))
def test_stop_string_split_at_every_position(cut: int) -> None:
    text = "Hello, STOP here"
    out, matched = run(["STOP"], [text[:cut], text[cut:]])
    assert "".join(out) == "Hello, "
    assert matched == "STOP"


def test_include_stop_str_in_output() -> None:
    out, matched = run(["ST", "STOP"], ["ab S", "TOP cd"], include=True)
    assert "".join(out) == "ab ST"  # the earliest (then shortest) match wins, as in any chunking
    assert matched == "ST"


def test_holds_only_possible_prefixes() -> None:
    m = StopStringMatcher(["</end>"])
    assert m.feed("a <") == "a "  # "<" may start the stop string
    assert m.feed("b") == "<b"  # it did not
    assert m.feed("</en") == ""
    assert m.feed("d>tail") == ""
    assert m.matched == "</end>"
    assert m.feed("more") == "" and m.flush() == ""


def test_no_match_releases_everything() -> None:
    out, matched = run(["xyz"], ["abc x", "y"])
    assert "".join(out) == "abc xy" and matched is None


def test_no_stop_strings_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""
