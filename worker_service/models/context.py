"""Per-step state the model runner sets before a forward and every attention layer reads.

Model code stays `forward(input_ids, positions)`; the runner wraps the call in
`forward_context(meta)` so each attention layer finds the step's metadata here
instead of receiving it through every layer call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from worker_service.attention.base import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """Make `meta` the current step's attention metadata for the duration of the block."""
    global _current
    previous, _current = _current, meta
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    """The metadata of the step being run; raises outside `forward_context`."""
    if _current is None:
        raise RuntimeError("attention layer called outside forward_context()")
    return _current


def current_attention_metadata() -> AttentionMetadata | None:
    """The metadata of the step being run, or None outside `forward_context`."""
    return _current
