"""Greedy tokens through the real EngineCore (its scheduler, async scheduling on, the
worker over its gRPC step stream) equal HF transformers generate in float32, in the
four scheduling regimes of test_greedy_vs_hf, and with a TPOT step budget."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scheduler_service.engine import EngineCore
from scheduler_service.worker_client import GrpcWorkerClient
from services.config import CacheConfig, SchedulerConfig
from services.step_types import SchedulerOutput
from services.types import EngineCoreRequest
from tests.worker.test_greedy_vs_hf import GREEDY, REGIMES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(fp32_worker: str) -> Iterator[GrpcWorkerClient]:
    c = GrpcWorkerClient(fp32_worker)
    yield c
    c.close()


@pytest.mark.parametrize("regime", list(REGIMES))
def test_engine_with_async_scheduling_matches_hf_fp32(
    regime: str,
    client: GrpcWorkerClient,
    eight_prompts: list[list[int]],
    hf_fp32_greedy: list[list[int]],
) -> None:
    num_blocks, budget, prefix, staggered = REGIMES[regime]
    engine = EngineCore(
        SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=True),
        CacheConfig(enable_prefix_caching=prefix, num_blocks_override=num_blocks),
        [client],
    )
    order = [2, 3, 4, 5, 0, 1, 6, 7]  # the long shared-prefix prompt first
    arrivals = [
        (2 * k if staggered else 0, EngineCoreRequest(f"{regime}-{i}", eight_prompts[i], GREEDY))
        for k, i in enumerate(order)
    ]
    outputs = drive(engine, arrivals)
    stats = engine.stats()
    engine.shutdown()
    if regime == "prefix_cache":
        assert stats.prefix_cache_hits >= 3 * 128
    if regime == "preemption":
        assert stats.num_preemptions > 0
    assert stats.num_blocks_used == 0
    for i, expected in enumerate(hf_fp32_greedy):
        assert outputs[f"{regime}-{i}"] == expected, f"prompt {i} diverges"


def test_engine_with_a_tpot_budget_matches_hf_fp32(
    client: GrpcWorkerClient, eight_prompts: list[list[int]], hf_fp32_greedy: list[list[int]]
) -> None:
    """--target-tpot-ms 1 (unreachable: every step with decodes carries the 64-token minimum
    chunk once a prefill was timed): long prompts arrive while short ones decode."""
    engine = EngineCore(
        SchedulerConfig(target_tpot_ms=1.0, async_scheduling=True),
        CacheConfig(enable_prefix_caching=False, num_blocks_override=512),
        [client],
    )
    steps: list[SchedulerOutput] = []
    engine.on_schedule = steps.append
    order = [0, 1, 6, 2, 3, 4, 5, 7]  # short prompts first, so that they decode
    arrivals = [
        (2 * k, EngineCoreRequest(f"tpot-{i}", eight_prompts[i], GREEDY))
        for k, i in enumerate(order)
    ]
    outputs = drive(engine, arrivals)
    engine.shutdown()
    chunks = [
        max(s.num_scheduled_tokens.values())
        for s in steps
        if 1 in s.num_scheduled_tokens.values() and max(s.num_scheduled_tokens.values()) > 1
    ]
    assert chunks.count(64) >= 5, chunks  # the 150..600-token prompts went by 64 with decodes
    assert engine.scheduler.step_budget.model.coef[2] > 0  # a prefill token's cost was learned
    for i, expected in enumerate(hf_fp32_greedy):
        assert outputs[f"tpot-{i}"] == expected, f"prompt {i} diverges"


def drive(
    engine: EngineCore, arrivals: list[tuple[int, EngineCoreRequest]]
) -> dict[str, list[int]]:
    """Step the engine to idle, adding each request at its step; the tokens per request."""
    outputs: dict[str, list[int]] = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            engine.add_request(arrivals.pop(0)[1])
        for out in engine.step():
            assert not out.error, out.error
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return outputs
