"""The TPOT step budget (--target-tpot-ms): the learned step cost, the prefill budget it
gives, decodes first, and the old behaviour with the target off."""

from __future__ import annotations

import pytest

from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler
from scheduler_service.step_budget import MIN_PREFILL_CHUNK, StepBudget, StepCostModel
from services.config import SchedulerConfig
from services.step_types import SchedulerOutput
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import expected_tokens, make_request, make_scheduler

Cost = tuple[float, float, float]  # seconds per (step, decode token, prefill token)
SLOW: Cost = (0.010, 0.001, 0.0005)  # 50 ms target, d decodes: (50-10-d)/0.5 = 80-2d prefill
FAST: Cost = (0.001, 0.0001, 0.00001)  # a 50 ms step carries thousands of prefill tokens


def split(output: SchedulerOutput) -> tuple[int, int]:
    """(decode tokens, prefill tokens) of a step: a request given one token is decoding."""
    counts = output.num_scheduled_tokens.values()
    return sum(n for n in counts if n == 1), sum(n for n in counts if n > 1)


def seconds(cost: Cost, output: SchedulerOutput) -> float:
    return seconds_of(*split(output), cost)


def seconds_of(num_decode: int, num_prefill: int, cost: Cost = SLOW) -> float:
    return cost[0] + cost[1] * num_decode + cost[2] * num_prefill


def decode_ready(scheduler: Scheduler) -> set[str]:
    """Running requests whose next step is one decode token."""
    return {
        r.request_id
        for r in scheduler.running
        if r.num_tokens + r.num_output_placeholders - r.num_computed_tokens - r.num_inflight_tokens
        == 1
    }


def run(
    scheduler: Scheduler,
    worker: FakeWorker,
    cost: Cost,
    arrivals: list[tuple[int, Request]] = [],  # noqa: B006 - read only
    max_steps: int = 2000,
) -> tuple[list[SchedulerOutput], dict[str, list[int]]]:
    """Step to idle, adding each request at its step and telling the step budget each step
    took `cost`; checks that every decode-ready request is scheduled each step. Returns
    the steps and the tokens streamed per request."""
    steps: list[SchedulerOutput] = []
    streamed: dict[str, list[int]] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    for index in range(max_steps):
        while pending and pending[0][0] <= index:
            scheduler.add_request(pending.pop(0)[1])
        if not (pending or scheduler.has_unfinished_requests()):
            return steps, streamed
        ready = decode_ready(scheduler)
        output = scheduler.schedule()
        missing = ready - output.num_scheduled_tokens.keys()
        assert not missing, f"decodes left out of step {output.step_id}: {missing}"
        for update in scheduler.update_from_output(output, worker.execute_model(output)):
            streamed.setdefault(update.request_id, []).extend(update.new_token_ids)
        scheduler.step_budget.observe(output, seconds(cost, output))
        steps.append(output)
    raise AssertionError("requests did not finish")


def workload() -> tuple[list[tuple[int, Request]], dict[str, list[int]]]:
    """Short prompts that decode long, one every 3 steps, and a 300-token prompt every
    25 steps from step 20 among them: (arrivals, prompts by request id)."""
    arrivals, prompts = [], {}
    for i in range(12):
        prompts[f"short-{i}"] = [(7 * i + k) % 900 + 1 for k in range(6)]
        arrivals.append((3 * i, f"short-{i}"))
    for i in range(3):
        prompts[f"long-{i}"] = [(11 * i + k) % 900 + 1 for k in range(300)]
        arrivals.append((20 + 25 * i, f"long-{i}"))
    requests = [
        (at, make_request(rid, prompts[rid], max_model_len=512, max_tokens=40))
        for at, rid in arrivals
    ]
    return requests, prompts


def make(target_tpot_ms: float, **kwargs: int) -> tuple[Scheduler, FakeWorker]:
    options = dict(num_blocks=1024, max_num_batched_tokens=512, max_num_seqs=32, max_model_len=512)
    options.update(kwargs)
    return make_scheduler(target_tpot_ms=target_tpot_ms, **options)  # type: ignore[arg-type]


def test_the_cost_model_recovers_a_linear_step_time() -> None:
    model = StepCostModel()
    for i in range(200):
        num_decode, num_prefill = i % 17, (i * 37) % 300
        model.observe(num_decode, num_prefill, seconds_of(num_decode, num_prefill))
    assert model.coef == pytest.approx(SLOW, rel=0.02)
    assert model.predict(10, 100) == pytest.approx(0.010 + 0.010 + 0.050, rel=0.01)


def test_the_budget_follows_the_target_and_keeps_the_cap_and_the_minimum_chunk() -> None:
    budget = StepBudget(target_tpot_ms=50)
    assert budget.prefill_budget(num_decode=4, budget_left=508) == 508  # nothing learned yet
    for i in range(200):
        num_decode, num_prefill = i % 17, (i * 37) % 300
        budget.model.observe(num_decode, num_prefill, seconds_of(num_decode, num_prefill))
    assert budget.prefill_budget(4, 508) == pytest.approx(80 - 2 * 4, abs=2)
    assert budget.prefill_budget(4, 30) == 30  # never above what the cap leaves
    assert budget.prefill_budget(30, 482) == MIN_PREFILL_CHUNK  # the decodes alone take 40 ms
    assert budget.prefill_budget(0, 512) == 512  # no decode, no TPOT to protect
    assert StepBudget(target_tpot_ms=0).prefill_budget(4, 508) == 508
    budget.model.coef = (0.049, -0.006, 0.0005)  # a noisy fit: more decodes, a cheaper step?
    assert budget.prefill_budget(20, 492) == MIN_PREFILL_CHUNK  # no: -0.006 is taken as 0


def test_slow_steps_bring_the_prefill_budget_down_and_outputs_are_unchanged() -> None:
    scheduler, worker = make(target_tpot_ms=50)
    arrivals, prompts = workload()
    steps, streamed = run(scheduler, worker, SLOW, arrivals)
    mixed = [split(s) for s in steps if split(s)[0] and split(s)[1]]
    # the first chunk of the first long prompt teaches the cost of a prefill token (6-token
    # prompts alone tell little); from then on every step keeps to the target
    first_chunk = next(i for i, (_, p) in enumerate(mixed) if p > 6)
    learned = mixed[first_chunk + 1 :]
    assert len(learned) > 10
    for num_decode, num_prefill in learned:  # (50-10-d)/0.5 prefill tokens, at least 64
        assert num_prefill <= max(80 - 2 * num_decode, MIN_PREFILL_CHUNK) + 2
    assert sum(p == MIN_PREFILL_CHUNK for _, p in learned) >= 3  # chunks of at least 64
    for request_id, prompt in prompts.items():
        assert streamed[request_id] == expected_tokens(prompt, 40)


def test_fast_steps_leave_the_cap_as_the_limit() -> None:
    scheduler, worker = make(target_tpot_ms=50, max_num_batched_tokens=256)
    steps, _ = run(scheduler, worker, FAST, workload()[0])
    assert max(s.total_num_scheduled_tokens for s in steps) == 256
    assert all(s.total_num_scheduled_tokens <= 256 for s in steps)
    assert any(split(s)[0] and split(s)[1] > 200 for s in steps[10:])  # fast: big chunks


def test_an_unreachable_target_still_moves_prompts_by_the_minimum_chunk() -> None:
    scheduler, worker = make(target_tpot_ms=1)  # below the 10 ms a step costs whatever it holds
    arrivals, prompts = workload()
    steps, streamed = run(scheduler, worker, SLOW, arrivals)
    mixed = [split(s) for s in steps[10:] if split(s)[0] and split(s)[1]]
    assert mixed and all(p <= MIN_PREFILL_CHUNK for _, p in mixed)
    assert any(p == MIN_PREFILL_CHUNK for _, p in mixed)
    assert all(streamed[r] == expected_tokens(p, 40) for r, p in prompts.items())


def test_target_off_schedules_to_the_cap_whatever_the_step_times() -> None:
    observed, worker_a = make(target_tpot_ms=0)
    steps_observed, _ = run(observed, worker_a, SLOW, workload()[0])
    plain, worker_b = make(target_tpot_ms=0)
    steps_plain, _ = run(plain, worker_b, FAST, workload()[0])
    assert [s.num_scheduled_tokens for s in steps_observed] == [
        s.num_scheduled_tokens for s in steps_plain
    ]
    assert observed.step_budget.model.num_observed == 0  # off: nothing is learned
    assert any(split(s)[0] and split(s)[1] > 200 for s in steps_observed)


def test_decodes_go_before_a_running_prompts_chunk() -> None:
    """A prompt admitted before short requests still prefills (by 100-token chunks, the
    long-prefill threshold) while they decode: the decodes are scheduled first, and the
    prompt's chunk is what the target leaves once they are in."""
    scheduler, worker = make(target_tpot_ms=50, long_prefill_token_threshold=100)
    for i in range(40):  # learn the SLOW cost from decode and prefill steps
        num_decode, num_prefill = i % 9, 37 * i % 200
        scheduler.step_budget.model.observe(
            num_decode, num_prefill, seconds_of(num_decode, num_prefill)
        )
    long_prompt = list(range(1, 401))
    scheduler.add_request(make_request("long", long_prompt, max_model_len=512))
    for i in range(20):
        short = make_request(f"short-{i}", [i + 1] * 4, max_model_len=512, max_tokens=30)
        scheduler.add_request(short)
    steps, streamed = run(scheduler, worker, SLOW)  # asserts the decodes every step
    assert steps[0].num_scheduled_tokens["long"] == 100  # no decodes yet: the threshold
    second = steps[1].num_scheduled_tokens
    assert list(second)[-1] == "long"  # behind the 20 decodes it follows in `running`
    assert second["long"] == MIN_PREFILL_CHUNK  # 20 decodes: (50-10-20)/0.5 = 40 < 64
    assert streamed["long"] == expected_tokens(long_prompt, 8)


def test_the_flag_is_validated() -> None:
    assert SchedulerConfig(target_tpot_ms=40.0).target_tpot_ms == 40.0
    with pytest.raises(ValueError, match="target_tpot_ms"):
        SchedulerConfig(target_tpot_ms=-1)
