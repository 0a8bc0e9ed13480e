"""Speculative decoding on the worker's side: n-gram drafts after sampling.

The worker holds every token of a request right after sampling, so it proposes: for
each request that may speculate it looks the last n tokens up earlier in the request's
own tokens (prompt lookup, n from prompt_lookup_max down to prompt_lookup_min) and
proposes the K tokens that followed the match. The scheduler schedules them next step;
worker_service.rejection_sampler verifies them.

A request speculates only when its sampling can be verified position by position with
the plain target distribution: no repetition / frequency / presence penalty (they
change with each accepted token), no structured output (the grammar would have to
advance across the drafts), no logprobs, no per-request seed at temperature > 0 (its
noise is tied to output positions), and min_tokens already reached. Such requests
decode one token a step as without speculation.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from services.config import SpeculativeConfig
from services.step_types import DraftTokens
from services.types import SamplingParams
from worker_service.input_batch import InputBatch, RequestState


def can_speculate(params: SamplingParams, num_outputs: int) -> bool:
    """Whether drafts of a request with `params` and `num_outputs` tokens can be verified."""
    return (
        params.repetition_penalty == 1
        and not params.frequency_penalty
        and not params.presence_penalty
        and params.structured_output is None
        and params.logprobs is None
        and (params.seed is None or params.greedy)
        and num_outputs >= params.min_tokens
    )


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` [L] with min_n <= n <= max_n tokens; empty when no suffix recurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # [L - n, n]: tokens[i:i+n]
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]  # matches followed by k tokens, else any
            start = int((full if full.size else hits)[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


class NgramProposer:
    """Prompt-lookup drafts for the requests that sampled this step."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, states: list[RequestState], batch: InputBatch) -> list[DraftTokens]:
        """Drafts per request (only those that got some), from the token table."""
        drafts = []
        for state in states:
            k = min(self.k, self.max_model_len - state.num_tokens - 1)
            if k <= 0 or not can_speculate(state.params, state.num_outputs):
                continue
            found = ngram_propose(
                batch.token_ids[state.row, : state.num_tokens], self.min_n, self.max_n, k
            )
            if found.size:
                drafts.append(DraftTokens(state.req_id, found.tolist()))
        return drafts
