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
from typing import TYPE_CHECKING

from scheduler_service.block_pool import KVCacheBlock
from scheduler_service.kv_cache_manager import KVCacheManager
from scheduler_service.request import Request, RequestStatus
from scheduler_service.step_plan import StepPlan
from services.step_types import ModelRunnerOutput
from services.types import EngineCoreOutput

_RUNNING = RequestStatus.RUNNING


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


class SpeculativeScheduling:
    """The Scheduler's speculative-decoding steps (a mixin of scheduler_service.scheduler)."""

    kv: KVCacheManager
    requests: dict[str, Request]
    block_size: int
    max_model_len: int
    num_spec_tokens: int  # K; 0: speculation off
    num_lookahead: int  # slots reserved past a request's tokens (draft model: K)
    spec_stats: SpecDecodeStats

    if TYPE_CHECKING:

        def _fail(self, request: Request, error: str) -> EngineCoreOutput: ...
        def _append_until_stop(
            self, request: Request, token_ids: list[int]
        ) -> tuple[list[int], RequestStatus | None]: ...
        def _token_output(
            self,
            request: Request,
            new_token_ids: list[int],
            status: RequestStatus | None,
        ) -> EngineCoreOutput: ...

    def _schedule_drafts(self, request: Request, plan: StepPlan) -> bool:
        """Schedule a decode with its pending drafts if their slots fit without preempting
        anyone; False (drafts dropped) leaves the plain decode to the caller."""
        drafts = fit_drafts(request, plan.budget - 1, self.max_model_len, self.num_spec_tokens)
        request.spec_token_ids = []
        if not drafts:
            return False
        new_block_ids = self._allocate(request, 1 + len(drafts))
        if new_block_ids is None:
            return False
        plan.add_cached(request, 1 + len(drafts), new_block_ids)
        plan.spec[request.request_id] = drafts
        return True

    def _allocate(
        self, request: Request, num_new: int, hits: list[KVCacheBlock] | None = None
    ) -> list[int] | None:
        """kv.allocate_slots, plus the draft model's lookahead slots when it has any."""
        if not self.num_lookahead:
            return self.kv.allocate_slots(request, num_new, hits)
        end = request.num_computed_tokens + request.num_inflight_tokens + num_new
        end += len(hits) * self.block_size if hits else 0
        extra = max(0, min(self.num_lookahead, self.max_model_len - end))
        return self.kv.allocate_slots(request, num_new + extra, hits)

    def _commit_drafts(
        self, request: Request, num_tokens: int, sampled: list[int] | None, num_drafts: int
    ) -> EngineCoreOutput | None:
        """Commit a decode that verified `num_drafts` drafts: only the KV of the accepted
        ones counts as computed (the rejected slots are rolled back)."""
        request.num_inflight_tokens -= num_tokens
        rejected = num_rejected(num_drafts, len(sampled) if sampled else 0)
        if sampled is None or rejected is None:
            return self._fail(request, "the worker returned a wrong token count for drafts")
        self.spec_stats.observe(num_drafts, num_drafts - rejected)
        request.num_computed_tokens += num_tokens - rejected
        request.num_output_placeholders -= 1
        new_token_ids, status = self._append_until_stop(request, sampled)
        if status is None and request.num_computed_tokens // self.block_size > (
            request.num_hashed_blocks
        ):
            self.kv.cache_computed_blocks(request)  # its token ids are known now
        return self._token_output(request, new_token_ids, status)

    def _keep_drafts(self, runner_output: ModelRunnerOutput) -> None:
        """Remember the drafts proposed for requests still running, for the next schedule()."""
        for draft in runner_output.draft_token_ids:
            request = self.requests.get(draft.request_id)
            if request is not None and request.status is _RUNNING:
                request.spec_token_ids = draft.token_ids
