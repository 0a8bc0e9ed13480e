"""Small builders shared by the scheduler tests."""

from __future__ import annotations

import itertools

from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler
from services.config import SchedulerConfig
from services.step_types import SchedulerOutput
from services.types import EngineCoreOutput, SamplingParams
from tests.scheduler.fake_worker import FakeWorker

_arrivals = itertools.count(1)


def make_scheduler(
    *,
    num_blocks: int = 32,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    max_model_len: int = 128,
    eos_token_ids: tuple[int, ...] = (),
    enable_prefix_caching: bool = True,
    rope_recompute_length: int = 0,
    target_tpot_ms: float = 0.0,
) -> tuple[Scheduler, FakeWorker]:
    """A scheduler and a fake worker whose pool has been initialized to match."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,  # type: ignore[arg-type]
        target_tpot_ms=target_tpot_ms,
    )
    scheduler = Scheduler(
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        enable_prefix_caching=enable_prefix_caching,
        rope_recompute_length=rope_recompute_length,
    )
    worker = FakeWorker(block_size=block_size, max_model_len=max_model_len)
    worker.initialize_cache(num_blocks)
    return scheduler, worker


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    max_model_len: int = 128,
    priority: int = 0,
    cache_salt: str = "",
    **params: object,
) -> Request:
    """A request with increasing arrival times (so arrival order = creation order)."""
    params.setdefault("max_tokens", 8)
    return Request(
        request_id,
        prompt,
        SamplingParams(**params),  # type: ignore[arg-type]
        max_model_len,
        arrival_time=float(next(_arrivals)),
        priority=priority,
        cache_salt=cache_salt,
    )


def step(
    scheduler: Scheduler, worker: FakeWorker
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One synchronous engine step: schedule, execute on the fake, update."""
    scheduler_output = scheduler.schedule()
    runner_output = worker.execute_model(scheduler_output)
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


def run_until_idle(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 1000
) -> dict[str, list[int]]:
    """Step until no request is left; returns the streamed token ids per request."""
    streamed: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return streamed
        for output in step(scheduler, worker)[1]:
            streamed.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError("requests did not finish")


def expected_tokens(prompt: list[int], n: int, vocab: int = 1000) -> list[int]:
    """What the fake model generates after `prompt`: last + 1, last + 2, ..."""
    return [(prompt[-1] + i) % vocab for i in range(1, n + 1)]
