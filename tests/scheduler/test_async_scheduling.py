"""Async scheduling: step n+1 is scheduled before step n's output is committed.

The scheduler-level loop here models the engine's pipeline exactly: the fake
worker runs each step as soon as it is scheduled (a worker runs steps in
order), but the scheduler commits step n only after it has scheduled step
n+1. The fake worker checks the contract on every step (computed counts, block
tables, the KV of every attended position), so placeholder accounting that
is off by one token fails loudly. The EngineCore tests run the real pipeline
(a worker thread) both ways and compare tokens.
"""

from __future__ import annotations

import random

import pytest

from scheduler_service.engine import EngineCore
from scheduler_service.pipeline import has_work
from scheduler_service.scheduler import Scheduler
from services.config import CacheConfig, SchedulerConfig
from services.step_types import ModelRunnerOutput, SchedulerOutput
from services.types import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import expected_tokens, make_request, make_scheduler
from tests.scheduler.test_invariants import check_invariants, random_prompt

Results = dict[str, tuple[list[int], FinishReason]]


class Pipeline:
    """Drives a Scheduler + FakeWorker one step ahead, like EngineCore with async scheduling."""

    def __init__(self, sched: Scheduler, worker: FakeWorker) -> None:
        self.sched, self.worker = sched, worker
        self.pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.results: Results = {}

    def step(self, fail: bool = False) -> list[EngineCoreOutput]:
        so = self.sched.schedule()
        check_invariants(self.sched)
        ran = (so, self.worker.execute_model(so)) if has_work(so) else None
        previous, self.pending = self.pending, ran
        if previous is None:
            return []
        if fail:
            updates = self.sched.fail_step(previous[0], "injected")
        else:
            updates = self.sched.update_from_output(*previous)
        check_invariants(self.sched)
        for out in updates:
            tokens, _ = self.results.get(out.request_id, ([], FinishReason.UNSPECIFIED))
            self.results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
        return updates

    def busy(self) -> bool:
        return self.pending is not None or self.sched.has_unfinished_requests()

    def drain(self, max_steps: int = 5000) -> Results:
        for _ in range(max_steps):
            if not self.busy():
                return self.results
            self.step()
        raise AssertionError("requests did not finish")


def test_decode_requests_are_scheduled_every_step_without_waiting_for_their_token() -> None:
    sched, worker = make_scheduler(num_blocks=32, block_size=4)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=6))
    pipe = Pipeline(sched, worker)
    results = pipe.drain()
    assert results["a"] == (expected_tokens([1, 2, 3], 6), FinishReason.LENGTH)
    # prefill + 5 decodes, each scheduled while the previous step was in flight; no extra step
    scheduled = [s for s in worker.steps if "a" in s.num_scheduled_tokens]
    assert len(scheduled) == 6
    assert [s.scheduled_cached_reqs.num_computed_tokens[0] for s in scheduled[1:]] == [
        3,
        4,
        5,
        6,
        7,
    ]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_a_request_that_stops_at_step_n_is_not_continued() -> None:
    sched, worker = make_scheduler(num_blocks=32, block_size=4, eos_token_ids=(9,))
    worker.eos_token_ids = (9,)
    sched.add_request(make_request("eos", [4, 5], max_tokens=20))  # 6 7 8 9=EOS
    sched.add_request(make_request("stop", [20], max_tokens=20, stop_token_ids=[23]))
    sched.add_request(make_request("other", [40], max_tokens=10))
    results = Pipeline(sched, worker).drain()
    assert results["eos"] == ([6, 7, 8, 9], FinishReason.STOP)
    assert results["stop"] == ([21, 22, 23], FinishReason.STOP)
    assert results["other"] == (expected_tokens([40], 10), FinishReason.LENGTH)
    # The step sent ahead still ran it once more; the step after tells the worker to drop it.
    last = max(i for i, s in enumerate(worker.steps) if "eos" in s.num_scheduled_tokens)
    assert any("eos" in s.finished_req_ids for s in worker.steps[last + 1 :])
    assert "eos" not in worker.requests and sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_the_last_token_under_max_tokens_is_not_scheduled_past() -> None:
    sched, worker = make_scheduler(num_blocks=32, block_size=4, max_model_len=12)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=4, max_model_len=12))
    results = Pipeline(sched, worker).drain()
    assert results["a"] == (expected_tokens([1, 2, 3, 4, 5, 6, 7, 8], 4), FinishReason.LENGTH)
    # never a step computing position 12 (the worker would have raised a ContractError)
    assert sum("a" in s.num_scheduled_tokens for s in worker.steps) == 4


def test_preemption_while_a_step_is_in_flight() -> None:
    sched, worker = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4)
    prompts = {f"r{i}": [10 * i + j for j in range(1, 6)] for i in range(1, 4)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=10))
    results = Pipeline(sched, worker).drain()
    assert sched.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert results[rid] == (expected_tokens(prompt, 10), FinishReason.LENGTH), rid
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_abort_and_failure_of_a_request_with_a_step_in_flight() -> None:
    sched, worker = make_scheduler(num_blocks=32, block_size=4)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, [5, 6], max_tokens=30))
    pipe = Pipeline(sched, worker)
    for _ in range(4):
        pipe.step()
    sched.abort_requests(["a"])
    pipe.step(fail=True)  # the step in flight fails: b and c end with ERROR
    results = pipe.drain()
    assert results["b"][1] == results["c"][1] == FinishReason.ERROR
    assert results["b"][0] == [7, 8, 9]  # the 3 steps committed before the failure, no more
    assert not worker.requests and sched.kv.pool.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize(("seed", "policy"), [(11, "fcfs"), (12, "priority"), (13, "fcfs")])
def test_random_traffic_gives_the_same_tokens_as_sync(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    sched, worker = make_scheduler(
        num_blocks=12,
        block_size=4,
        max_num_batched_tokens=rng.choice([6, 10, 24]),
        max_num_seqs=rng.choice([3, 6]),
        long_prefill_token_threshold=rng.choice([0, 5]),
        policy=policy,
        max_model_len=40,
    )
    pipe = Pipeline(sched, worker)
    prompts: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    aborted: set[str] = set()
    for i in range(2000):
        if i < 1800 and rng.random() < 0.12:
            rid = f"r{i}"
            prompts[rid] = random_prompt(rng)
            max_tokens[rid] = rng.randint(1, 40 - len(prompts[rid]))
            request = make_request(rid, prompts[rid], max_model_len=40, max_tokens=max_tokens[rid])
            request.priority = rng.randint(0, 3)
            sched.add_request(request)
        if sched.requests and rng.random() < 0.03:
            victim = rng.choice(list(sched.requests))
            aborted.add(victim)
            for out in sched.abort_requests([victim]):
                pipe.results[victim] = (pipe.results.get(victim, ([], 0))[0], out.finish_reason)
        pipe.step()
    results = pipe.drain()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    assert set(results) | aborted >= set(prompts)
    completed = [r for r in prompts if r not in aborted]
    assert len(completed) > len(prompts) // 2
    for rid in completed:
        assert results[rid] == (
            expected_tokens(prompts[rid], max_tokens[rid]),
            FinishReason.LENGTH,
        ), rid
    assert sched.num_preemptions > 0 and sched.kv.prefix_hits > 0


# ---- the real pipeline: EngineCore with a worker thread ----------------------------------


def run_engine(async_scheduling: bool, requests: list[EngineCoreRequest], **config: int) -> Results:
    worker = FakeWorker(eos_token_ids=(500,), available_blocks=config.pop("blocks", 64))
    engine = EngineCore(
        SchedulerConfig(async_scheduling=async_scheduling, **config),  # type: ignore[arg-type]
        CacheConfig(),
        [worker],
    )
    for request in requests:
        engine.add_request(request)
    results: Results = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens, _ = results.get(out.request_id, ([], FinishReason.UNSPECIFIED))
            results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_blocks_used == 0
    engine.shutdown()
    return results


@pytest.mark.parametrize("blocks", [64, 14], ids=["roomy", "preempting"])
def test_engine_tokens_are_the_same_with_async_scheduling_on_and_off(blocks: int) -> None:
    rng = random.Random(blocks)
    requests = [
        EngineCoreRequest(
            f"q{i}",
            [rng.randrange(480, 499) for _ in range(rng.randint(1, 20))],
            SamplingParams(max_tokens=rng.randint(1, 24), stop_token_ids=(3,), logprobs=1),
        )
        for i in range(12)
    ]
    config = {"max_num_batched_tokens": 16, "max_num_seqs": 6, "blocks": blocks}
    on = run_engine(True, requests, **config)
    off = run_engine(False, requests, **config)
    assert on == off
    assert any(reason == FinishReason.STOP for _, reason in on.values())  # hit EOS 500
