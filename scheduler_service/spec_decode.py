"""Speculative decoding on the scheduler's side: which drafts a step verifies, what it keeps.

The workers propose drafts after sampling (ModelRunnerOutput.draft_token_ids); the
scheduler keeps them on the request and schedules them the next step as extra tokens
after the request's last one: num_scheduled_tokens = 1 + len(drafts), with KV slots for
all of them. The worker verifies them in that forward and returns the accepted drafts
plus one token of its own (a correction or the bonus). Only 1 + num_accepted tokens are
committed as computed: the slots of rejected drafts stay in the request's blocks and are
overwritten by later steps, so nothing leaks and no prefix hash covers unverified KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.request import Request


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode_num_drafts / _draft_tokens / _accepted_tokens)."""

    num_drafts: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted


def fit_drafts(request: Request, budget: int, max_model_len: int, k: int) -> list[int]:
    """The request's pending drafts cut to what this step can verify: the token budget left
    after its own decode token, at most k, and no draft past max_tokens or max_model_len
    (all drafts accepted plus the bonus token must still be a legal output)."""
    drafts = request.spec_token_ids
    room = min(
        k,
        budget,
        request.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens - 1,
    )
    if room <= 0:
        return []
    return drafts[:room] if len(drafts) > room else drafts


def num_rejected(num_drafts: int, num_sampled: int) -> int | None:
    """Drafts rejected when the worker returned `num_sampled` tokens for `num_drafts` drafts
    (accepted drafts + 1); None when that count is impossible."""
    if not 1 <= num_sampled <= num_drafts + 1:
        return None
    return num_drafts + 1 - num_sampled
