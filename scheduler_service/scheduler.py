"""Continuous batching: who runs each step, with how many tokens, in which blocks.

One step = one token budget. Running requests are served first, decodes
before the next chunks of running prompts, then waiting ones are admitted
while the budget, `max_num_seqs` and the pool allow. With a TPOT target
(step_budget) the prefill part of a step with decodes is cut to what keeps
the step within the target. When a running request cannot get a block, the
lowest-priority / latest-arrived running request is preempted by recompute:
its blocks are freed and it goes back to the front of the queue.

Progress is committed only in `update_from_output`: `num_computed_tokens`
sent to the workers is what is in the pool before the step, and a failed
step (`fail_step`) leaves no phantom progress.

Async scheduling (the engine schedules step n+1 before step n's output is
back): a request keeps counts of its tokens in flight and of the tokens being
sampled for it (placeholders). Step n+1 plans from those counts, so a decode
request is scheduled again at once: the worker appended the token it sampled
to its own copy, and the slot for it is reserved here. A request that turns
out finished at step n has its step n+1 result discarded (it is gone from
`requests`) and is dropped from the workers the step after. Prefix hashes
cover committed tokens only.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable

from scheduler_service.encoder_budget import fit_encoder_budget
from scheduler_service.kv_cache_manager import KVCacheManager
from scheduler_service.lora_admission import lora_fits, running_loras
from scheduler_service.request import Request, RequestStatus
from scheduler_service.request_outputs import append_until_stop, final_output, token_output
from scheduler_service.request_queue import make_queue
from scheduler_service.spec_decode import SpecDecodeStats, SpeculativeScheduling
from scheduler_service.step_budget import StepBudget
from scheduler_service.step_plan import StepPlan
from services.config import SchedulerConfig
from services.iteration_tokens import TokenHistogram
from services.step_types import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from services.types import EngineCoreOutput, TokenLogprobs

_RECENT = 256  # samples kept for the medians in stats()
_RUNNING = RequestStatus.RUNNING  # module constants: enum attribute lookups cost in hot loops


class Scheduler(SpeculativeScheduling):
    """Owns every unfinished request, the waiting queue, the running set and the KV blocks."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        enable_prefix_caching: bool = True,
        pooled_prefix_hits: bool = False,
        sliding_window: int = 0,
        rope_recompute_length: int = 0,
    ) -> None:
        self.config = config
        self.rope_recompute_length = rope_recompute_length  # see KVCacheSpec
        self.pooled_prefix_hits = pooled_prefix_hits  # LAST pooling: only the last row counts
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window)
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self._known: set[str] = set()  # requests whose state the workers hold
        self._finished_ids: list[str] = []  # to report in the next step
        self._preempted_ids: list[str] = []
        self._pooled: dict[str, bytes] = {}  # vectors of the step being committed, by request
        self._logprobs: dict[str, list[TokenLogprobs]] = {}  # and its sampled tokens' logprobs
        self._step_id = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_steps = 0
        self.iteration_tokens = TokenHistogram()  # steps by tokens scheduled
        self.queue_times: deque[float] = deque(maxlen=_RECENT)
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        # a draft model writes KV for its K proposals past the request's tokens
        self.num_lookahead = self.num_spec_tokens if spec and spec.method == "draft_model" else 0
        self.spec_stats = SpecDecodeStats()
        self.step_budget = StepBudget(config.target_tpot_ms, self.num_spec_tokens)  # learns

    # ---- admission and abort -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (validated by the caller: it fits the model and the pool)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish the given requests as ABORT and free their blocks; unknown ids are ignored."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(final_output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- schedule -----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step: running requests first, then admissions."""
        plan = StepPlan(self.config.max_num_batched_tokens, self.config.encoder_budget)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self._step_id += 1
        output = plan.to_output(self._step_id, self._finished_ids, self._preempted_ids)
        self._finished_ids, self._preempted_ids = [], []
        for request in plan.new:
            _reserve(request, plan.num_scheduled[request.request_id])
        for request, _ in plan.cached:
            _reserve(request, plan.num_scheduled[request.request_id])
        self._known.update(r.request_id for r in plan.new)
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        """Decodes first, then (within the TPOT budget, if any) running prompts' next chunks."""
        prefills: list[tuple[Request, int]] = []
        for request in list(self.running):
            if plan.budget <= 0:
                break
            num_remaining = self._num_remaining(request, plan)
            if num_remaining == 1:
                self._schedule_tokens(request, 1, plan)
            elif num_remaining > 1:
                prefills.append((request, num_remaining))
        num_decode = self.config.max_num_batched_tokens - plan.budget
        plan.budget = self.step_budget.prefill_budget(num_decode, plan.budget)
        for request, num_remaining in prefills:
            if plan.budget <= 0:
                break
            if request.status is not _RUNNING:
                continue  # preempted for a decode's blocks
            num_new = self._chunk_size(num_remaining, plan)
            if request.mm_inputs:
                start = request.num_computed_tokens + request.num_inflight_tokens
                num_new = self._fit_encoder(request, start, num_new, plan)
            if num_new:
                self._schedule_tokens(request, num_new, plan)

    def _num_remaining(self, request: Request, plan: StepPlan) -> int:
        """Tokens `request` still has to compute; 0 where it sits this step out."""
        if request.status is not _RUNNING:
            return 0  # preempted earlier in this loop
        if self.rope_recompute_length and self._recomputes_for_rope(request, plan):
            return 0
        placeholders = request.num_output_placeholders
        if placeholders and request.num_output_tokens + placeholders >= request.max_tokens:
            return 0  # its last token is being sampled in the step in flight
        return (
            request.num_tokens
            + placeholders
            - request.num_computed_tokens
            - request.num_inflight_tokens
        )

    def _schedule_tokens(self, request: Request, num_new: int, plan: StepPlan) -> None:
        """Give a running request `num_new` tokens (drafts for a decode with proposals)."""
        if num_new == 1 and request.spec_token_ids and self._schedule_drafts(request, plan):
            return
        new_block_ids = self._allocate(request, num_new)
        if new_block_ids is None:
            new_block_ids = self._preempt_until_fits(request, num_new, plan)
        if new_block_ids is not None:
            plan.add_cached(request, num_new, new_block_ids)

    def _recomputes_for_rope(self, request: Request, plan: StepPlan) -> bool:
        """Whether `request` sits out this step because its next token takes it past
        rope_recompute_length while its keys were rotated for a shorter length: it is then
        preempted (recomputed whole, at its new length, as HF's Phi-3 generate does); with a
        step in flight it waits for that step's token first."""
        limit = self.rope_recompute_length
        next_position = request.num_computed_tokens + request.num_inflight_tokens
        if request.num_admitted_tokens > limit or next_position < limit:
            return False
        if not request.num_inflight_tokens:
            self._preempt(request, plan)
        return True

    def _preempt_until_fits(
        self, request: Request, num_new: int, plan: StepPlan
    ) -> list[int] | None:
        """Preempt victims until `num_new` tokens fit; None when `request` itself was the victim."""
        while True:
            victim = max(self.running, key=Request.sort_key)
            self._preempt(victim, plan)
            if victim is request:
                return None
            new_block_ids = self._allocate(request, num_new)
            if new_block_ids is not None:
                return new_block_ids

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        plan.unschedule(request)
        plan.preempted.append(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_inflight_tokens = request.num_output_placeholders = 0  # its result is dropped
        if not request.num_output_tokens:  # mid-prefill: the prompt logprobs are computed afresh
            request.pending_prompt_logprobs = []
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self.waiting.prepend(request)
        self.num_preemptions += 1
        if request.request_id in self._known:
            self._known.discard(request.request_id)
            self._preempted_ids.append(request.request_id)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        loras = running_loras(self.running) if self.config.lora.enable_lora else None
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if loras is not None and not lora_fits(request, loras, self.config.lora.max_loras):
                break  # its adapter waits for a slot: at most max_loras adapters run at once
            if not self._admit(request, plan):
                break

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        """Move the head of the queue into the running set if its first chunk fits."""
        if request.pooling_params is None or self.pooled_prefix_hits:
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        else:
            hits, num_hit_tokens = [], 0
        num_new = self._chunk_size(request.num_tokens - num_hit_tokens, plan)
        if request.mm_inputs:
            num_new = self._fit_encoder(request, num_hit_tokens, num_new, plan)
        if num_new == 0 or self._allocate(request, num_new, hits) is None:
            return False
        self.waiting.pop()
        request.num_admitted_tokens = request.num_tokens
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        self._note_first_schedule(request, num_hit_tokens)
        self.running.append(request)
        plan.add_new(request, num_new, resumed)
        return True

    def _note_first_schedule(self, request: Request, num_hit_tokens: int) -> None:
        if request.num_cached_tokens >= 0:
            return
        request.num_cached_tokens = num_hit_tokens
        request.timestamps.scheduled = time.time()
        self.queue_times.append(request.timestamps.scheduled - request.timestamps.queued)

    def _chunk_size(self, num_remaining: int, plan: StepPlan) -> int:
        """Tokens to give a request this step: capped by the long-prefill threshold and the budget."""
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_remaining:
            num_remaining = threshold
        if num_remaining > plan.budget and not self.config.enable_chunked_prefill:
            return 0
        return min(num_remaining, plan.budget)

    def _fit_encoder(self, request: Request, start: int, num_new: int, plan: StepPlan) -> int:
        """`num_new` cut before the first image the step's encoder budget cannot take."""
        total = self.config.encoder_budget
        num_new, used = fit_encoder_budget(request, start, num_new, plan.encoder_budget, total)
        if num_new > 0:
            plan.encoder_budget -= used
        return num_new

    # ---- update -------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Commit a finished step: progress, sampled tokens, stops; returns the updates to publish."""
        sampled = runner_output.sampled_by_request()
        if runner_output.sampled_logprobs or self._logprobs:
            self._logprobs = {s.request_id: s.logprobs for s in runner_output.sampled_logprobs}
        if runner_output.pooler_output or self._pooled:
            self._pooled = {p.request_id: p.data for p in runner_output.pooler_output}
        prompt_lps = {lp.request_id: lp.logprobs for lp in runner_output.prompt_logprobs}
        errors = runner_output.request_errors
        outputs = []
        get_request, get_sampled = self.requests.get, sampled.get
        drafts = {
            d.request_id: len(d.token_ids) for d in scheduler_output.scheduled_spec_decode_tokens
        }
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = get_request(request_id)
            if request is None or request.status is not _RUNNING:
                continue  # finished, aborted or preempted since the step was scheduled
            if request.num_inflight_tokens < num_tokens:
                continue  # preempted and scheduled afresh since: this result is stale
            if errors and request_id in errors:
                outputs.append(self._fail(request, errors[request_id]))
                continue
            if prompt_lps and request_id in prompt_lps:
                request.pending_prompt_logprobs.extend(prompt_lps[request_id])
            if drafts and request_id in drafts:
                output = self._commit_drafts(
                    request, num_tokens, get_sampled(request_id), drafts[request_id]
                )
            else:
                output = self._commit(request, num_tokens, get_sampled(request_id))
            if output is not None:
                outputs.append(output)
        if runner_output.draft_token_ids and self.num_spec_tokens:
            self._keep_drafts(runner_output)
        self.num_steps += 1
        if scheduler_output.total_num_scheduled_tokens:
            self.iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)
        return outputs

    def _commit(
        self, request: Request, num_tokens: int, sampled: list[int] | None
    ) -> EngineCoreOutput | None:
        request.num_inflight_tokens -= num_tokens
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens // self.block_size > request.num_hashed_blocks:
            self.kv.cache_computed_blocks(request)
        if self.kv.sliding_window:
            self.kv.free_outside_window(request)
        if request.num_computed_tokens < request.num_tokens:
            return None  # inside a prefill: a token sampled here is discarded
        request.num_output_placeholders -= 1
        if not sampled:
            if request.pooling_params is not None:
                return self._pooled_output(request)
            return self._fail(request, "the worker returned no token for a completed prefill")
        new_token_ids, status = self._append_until_stop(request, sampled)
        return self._token_output(request, new_token_ids, status)

    def _append_until_stop(
        self, request: Request, token_ids: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        return append_until_stop(request, token_ids, self.eos_token_ids, self.max_model_len)

    def _token_output(
        self,
        request: Request,
        new_token_ids: list[int],
        status: RequestStatus | None,
    ) -> EngineCoreOutput:
        logprobs = self._logprobs.get(request.request_id, []) if self._logprobs else []
        output = token_output(request, new_token_ids, logprobs)
        if status is not None:
            self._finish(request, status)
            output.finish_reason = request.status.finish_reason
            output.stop_reason = request.stop_reason
        return output

    def _pooled_output(self, request: Request) -> EngineCoreOutput:
        """A pooled prompt is computed: its vector; done (FINISHED_STOPPED), blocks freed."""
        data = self._pooled.get(request.request_id)
        if not data:
            return self._fail(request, "the worker returned no vector for a pooled prompt")
        request.timestamps.first_token = time.time()
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        output = final_output(request)
        output.pooling_output = data
        return output

    # ---- failures -----------------------------------------------------------

    def fail_step(self, scheduler_output: SchedulerOutput, error: str) -> list[EngineCoreOutput]:
        """Roll back a step whose execution raised: its requests end with ERROR, nothing is committed.

        The worker may not have applied the step's finished / preempted ids, so
        they are reported again next step (workers ignore unknown ids).
        """
        self._finished_ids.extend(scheduler_output.finished_req_ids)
        self._preempted_ids.extend(scheduler_output.preempted_req_ids)
        outputs = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                outputs.append(self._fail(request, error))
        return outputs

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """End every unfinished request with ERROR (the workers are gone)."""
        return [self._fail(request, error) for request in list(self.requests.values())]

    def _fail(self, request: Request, error: str) -> EngineCoreOutput:
        request.error = error
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return final_output(request)

    # ---- finishing ----------------------------------------------------------

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Take the request out of its queue, free its blocks, tell the workers next step."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self.num_finished += 1
        if request.request_id in self._known:
            self._known.discard(request.request_id)
            self._finished_ids.append(request.request_id)

    # ---- figures --------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        """Counts and counters; step time and health are filled in by the engine."""
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_blocks_total=pool.num_blocks,
            num_blocks_used=pool.num_used_blocks,
            kv_cache_usage=pool.usage(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            queue_time_p50=statistics.median(list(self.queue_times) or [0.0]),
            num_finished=self.num_finished,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            iteration_tokens_bucket_counts=list(self.iteration_tokens.counts),
            iteration_tokens_sum=self.iteration_tokens.sum,
        )


def _reserve(request: Request, num_tokens: int) -> None:
    """Count a scheduled step as in flight; one that reaches the end will sample a token."""
    request.num_inflight_tokens += num_tokens
    computed = request.num_computed_tokens + request.num_inflight_tokens
    if computed >= request.num_tokens + request.num_output_placeholders:
        request.num_output_placeholders += 1
