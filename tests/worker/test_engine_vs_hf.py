"""Greedy tokens through the real EngineCore (its scheduler, async scheduling on, the
worker over its gRPC step stream) equal HF transformers generate in float32, in the
four scheduling regimes of test_greedy_vs_hf."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scheduler_service.engine import EngineCore
from scheduler_service.worker_client import GrpcWorkerClient
from services.config import CacheConfig, SchedulerConfig
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
    outputs: dict[str, list[int]] = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            engine.add_request(arrivals.pop(0)[1])
        for out in engine.step():
            assert not out.error, out.error
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    stats = engine.stats()
    engine.shutdown()
    if regime == "prefix_cache":
        assert stats.prefix_cache_hits >= 3 * 128
    if regime == "preemption":
        assert stats.num_preemptions > 0
    assert stats.num_blocks_used == 0
    for i, expected in enumerate(hf_fp32_greedy):
        assert outputs[f"{regime}-{i}"] == expected, f"prompt {i} diverges"
