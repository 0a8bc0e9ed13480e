"""Decoding constraints -> llguidance grammars: validation (gateway) and the text the worker compiles.

Backend choice (measured on Intel Sapphire Rapids, 2 cores, shared and noisy; SmolLM2's
49,152-token vocabulary; the 20 schemas of tests/structured_schemas.py; xgrammar 0.2.9 vs
llguidance 1.9.1):
- compile a JSON schema: xgrammar median 6-11 ms (max 23-33 ms), llguidance median 0.6-0.8 ms;
- per-step mask fill at batch 32: both well under 1 ms (xgrammar 0.03-0.1 ms, llguidance
  0.06-0.5 ms), negligible next to a decode step;
- correctness: random walks through the token mask (3 seeds x 20 schemas) gave 0/60 invalid
  JSON with llguidance and 4/60 with xgrammar, which lets raw control characters into strings
  (json.loads rejects them).
Applying a mask: llguidance's torch helper goes through torch.compile and took 0.3-2.5 s per
call here, xgrammar's 9-18 ms at batch 32; worker_service.sampler.apply_bitmask unpacks the
bitmask with one byte-table gather instead. So Tessera uses llguidance. This module imports no torch: the gateway calls `check()` to turn
bad constraints into 400s, and the worker builds its matchers from `grammar_text()`.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance

from services.types import StructuredOutputParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON (no free whitespace): fewer tokens, and a small model cannot loop on spaces.
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
_CACHE_SIZE = 1024


def check(params: StructuredOutputParams) -> None:
    """ValueError with a user-facing message when the constraint cannot compile (cached)."""
    error = _error(params)
    if error:
        raise ValueError(error)


def grammar_text(params: StructuredOutputParams) -> str:
    """The llguidance grammar for `params`; ValueError when it is invalid."""
    check(params)
    return _grammar(params)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _error(params: StructuredOutputParams) -> str:
    """'' when the constraint compiles, else why not."""
    kind = _kind(params)
    try:
        if params.json is not None:
            json.loads(params.json)
        if params.choice is not None and not params.choice:
            message = "choice must list at least one string"
        else:
            message = llguidance.LLMatcher.validate_grammar(_grammar(params))
    except (ValueError, TypeError) as exc:
        message = str(exc)
    return f"invalid {kind} constraint: {message.strip()}" if message else ""


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _grammar(params: StructuredOutputParams) -> str:
    if params.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=_JSON_DEFAULTS)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults=_JSON_DEFAULTS
        )
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
    assert params.grammar is not None  # StructuredOutputParams sets exactly one field
    return llguidance.grammar_from("grammar", params.grammar)


def _kind(params: StructuredOutputParams) -> str:
    if params.json is not None:
        return "JSON schema"
    if params.json_object:
        return "json_object"
    if params.regex is not None:
        return "regex"
    return "choice" if params.choice is not None else "grammar"
