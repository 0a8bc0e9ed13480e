"""What one engine step is being given, while `Scheduler.schedule()` builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.request import Request
from services.step_types import CachedRequestData, DraftTokens, NewRequestData, SchedulerOutput


@dataclass(slots=True)
class StepPlan:
    """Requests scheduled so far this step and the token budget left."""

    budget: int
    encoder_budget: int = 0  # multimodal placeholder tokens the step may still encode
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new: list[Request] = field(default_factory=list)  # sent in full
    resumed: set[str] = field(default_factory=set)  # of `new`, back from preemption
    cached: list[tuple[Request, list[int]]] = field(default_factory=list)  # (request, new blocks)
    preempted: list[Request] = field(default_factory=list)
    spec: dict[str, list[int]] = field(default_factory=dict)  # drafts scheduled, by request id

    def add_new(self, request: Request, num_tokens: int, resumed: bool) -> None:
        self.new.append(request)
        if resumed:
            self.resumed.add(request.request_id)
        self._count(request, num_tokens)

    def add_cached(self, request: Request, num_tokens: int, new_block_ids: list[int]) -> None:
        self.cached.append((request, new_block_ids))
        self.num_scheduled[request.request_id] = num_tokens  # _count inlined: the hot path
        self.budget -= num_tokens

    def _count(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.request_id] = num_tokens
        self.budget -= num_tokens

    def unschedule(self, request: Request) -> None:
        """Take back a request scheduled earlier in this step (it is being preempted)."""
        num_tokens = self.num_scheduled.pop(request.request_id, None)
        if num_tokens is None:
            return
        self.budget += num_tokens
        self.spec.pop(request.request_id, None)
        self.cached = [(r, ids) for r, ids in self.cached if r is not request]
        self.new = [r for r in self.new if r is not request]

    def to_output(
        self, step_id: int, finished_ids: list[str], preempted_ids: list[str]
    ) -> SchedulerOutput:
        """The wire form: new requests in full, known ones as deltas."""
        cached = CachedRequestData()
        for r, ids in self.cached:
            cached.add(r.request_id, r.num_computed_tokens + r.num_inflight_tokens, ids)
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=[self._new_data(r) for r in self.new],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            finished_req_ids=finished_ids,
            preempted_req_ids=preempted_ids,
            scheduled_spec_decode_tokens=[DraftTokens(r, d) for r, d in self.spec.items()],
        )

    def _new_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            block_ids=list(request.block_ids),
            num_computed_tokens=request.num_computed_tokens,
            mm_inputs=request.mm_inputs,
            resumed_from_preemption=request.request_id in self.resumed,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
        )
