"""Stop strings matched across token boundaries on a stream of text deltas.

Text that may still turn into a stop string is held back; on a match the text
is cut before the stop string (or after it with `include_stop_str_in_output`)
and the caller ends the engine request. Free of HTTP concerns so the offline
API can reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Find the first of several stop strings in a growing text."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include = include_stop_str_in_output
        self.matched: str | None = None  # the stop string that ended the text
        self._pending = ""  # text not yet released: a possible start of a stop string

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str) -> str:
        """Add `delta`; return the text that is safe to emit now (nothing once stopped)."""
        if self.stopped:
            return ""
        if not self.stop:
            return delta
        self._pending += delta
        match = self._first_match()
        if match is not None:
            index, stop = match
            self.matched = stop
            end = index + len(stop) if self.include else index
            released, self._pending = self._pending[:end], ""
            return released
        keep = self._held_suffix_len()
        released = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return released

    def flush(self) -> str:
        """At the end of the sequence: release what was held (nothing matched)."""
        released, self._pending = self._pending, ""
        return "" if self.stopped else released

    def _first_match(self) -> tuple[int, str] | None:
        found = [(i, s) for s in self.stop if (i := self._pending.find(s)) >= 0]
        return min(found, key=lambda m: (m[0], len(m[1]))) if found else None

    def _held_suffix_len(self) -> int:
        """Length of the longest suffix of the pending text that starts some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if stop.startswith(self._pending[-n:]):
                    longest = n
                    break
        return longest
