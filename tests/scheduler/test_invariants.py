"""Randomized: thousands of steps on a tiny pool, with arrivals, aborts and failures.

After every step the block accounting must hold; the fake worker meanwhile
checks that every KV slot a step attends to holds the right prefix. At the end
every block is free and every request that ran to completion produced exactly
the tokens the deterministic model dictates.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from scheduler_service.request import RequestStatus
from scheduler_service.scheduler import Scheduler
from services.types import FinishReason
from tests.scheduler.helpers import expected_tokens, make_request, make_scheduler

PREFIXES = [list(range(100, 108)), list(range(300, 306)), [7, 7, 7, 7, 7]]


def check_invariants(sched: Scheduler) -> None:
    pool = sched.kv.pool
    owners: Counter[int] = Counter()
    for request in sched.requests.values():
        table = request.block_ids
        assert len(set(table)) == len(table), f"{request} owns a block twice"
        owners.update(table)
        if request.status != RequestStatus.RUNNING:
            assert not table, f"{request} holds blocks while not running"
        else:
            needed = -(-request.num_computed_tokens // sched.block_size)
            assert len(table) >= needed
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"{block}: owners {owners[block.block_id]}"
        if owners[block.block_id] > 1:
            assert block.block_hash is not None, f"{block} is shared but holds no cached prefix"
    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    assert all(b.ref_cnt == 0 for b in free)
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    assert pool.num_used_blocks == len(owners)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert len(sched.running) <= sched.config.max_num_seqs
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)


def random_prompt(rng: random.Random) -> list[int]:
    prefix = rng.choice(PREFIXES) if rng.random() < 0.6 else []
    return prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 14))]


@pytest.mark.parametrize(("seed", "policy"), [(1, "fcfs"), (2, "priority"), (3, "fcfs")])
def test_random_traffic_keeps_block_accounting_exact(seed: int, policy: str) -> None:
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
    prompts: dict[str, list[int]] = {}
    streamed: dict[str, list[int]] = {}
    finals: dict[str, FinishReason] = {}
    max_tokens: dict[str, int] = {}
    for i in range(2500):
        if i < 2200 and rng.random() < 0.12:
            rid = f"r{i}"
            prompts[rid] = random_prompt(rng)
            max_tokens[rid] = rng.randint(1, 40 - len(prompts[rid]))
            sched.add_request(
                make_request(
                    rid,
                    prompts[rid],
                    max_model_len=40,
                    max_tokens=max_tokens[rid],
                    priority=rng.randint(0, 3),
                )
            )
        if sched.requests and rng.random() < 0.04:
            victim = rng.choice(list(sched.requests))
            for out in sched.abort_requests([victim]):
                finals[out.request_id] = out.finish_reason
        scheduler_output = sched.schedule()
        check_invariants(sched)
        if scheduler_output.num_scheduled_tokens and rng.random() < 0.01:
            updates = sched.fail_step(scheduler_output, "injected")
        else:
            runner_output = worker.execute_model(scheduler_output)
            updates = sched.update_from_output(scheduler_output, runner_output)
        for out in updates:
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
        check_invariants(sched)
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        scheduler_output = sched.schedule()
        runner_output = worker.execute_model(scheduler_output)
        for out in sched.update_from_output(scheduler_output, runner_output):
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
        check_invariants(sched)

    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    assert set(finals) == set(prompts)
    completed = [rid for rid, reason in finals.items() if reason == FinishReason.LENGTH]
    assert len(completed) > len(prompts) // 2
    for rid in completed:
        assert streamed[rid] == expected_tokens(prompts[rid], max_tokens[rid]), rid
    assert sched.num_preemptions > 0
    assert sched.kv.prefix_hits > 0
