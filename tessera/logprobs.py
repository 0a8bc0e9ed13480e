"""Logprobs in vLLM's offline shape: one `{token_id: Logprob}` dict per position."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.types import TokenLogprobs


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's `vllm.logprobs.Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 + the number of tokens more likely
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


def position_logprobs(entry: TokenLogprobs, decode: Callable[[int], str]) -> PositionLogprobs:
    """One position's logprobs, in TokenLogprobs.ranked's order."""
    return {t: Logprob(lp, rank, decode(t)) for t, (lp, rank) in entry.ranked().items()}


def prompt_logprobs(
    entries: list[TokenLogprobs], decode: Callable[[int], str]
) -> list[PositionLogprobs | None]:
    """vLLM's prompt logprobs: None for the first prompt token (nothing predicts it), then one
    dict per later prompt token."""
    return [None, *(position_logprobs(e, decode) for e in entries)]
