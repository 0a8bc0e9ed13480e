"""Acceptance 1: greedy tokens from the worker (over gRPC, driven like a scheduler) equal HF
transformers generate in float32, token for token, in four scheduling regimes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scheduler_service.worker_client import GrpcWorkerClient
from services.types import SamplingParams
from tests.worker.driver import DriverRequest, MiniScheduler

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

# regime -> (num_blocks, token budget per step, prefix caching, staggered arrivals)
REGIMES = {
    "one_batch": (512, 8192, False, False),
    "chunked_prefill": (512, 96, False, False),
    "prefix_cache": (512, 2048, True, True),
    "preemption": (60, 1024, False, False),
}


@pytest.fixture(scope="module")
def client(fp32_worker: str) -> Iterator[GrpcWorkerClient]:
    c = GrpcWorkerClient(fp32_worker)
    yield c
    c.close()


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_hf_fp32(
    regime: str,
    client: GrpcWorkerClient,
    eight_prompts: list[list[int]],
    hf_fp32_greedy: list[list[int]],
) -> None:
    num_blocks, budget, prefix, staggered = REGIMES[regime]
    spec = client.get_kv_cache_spec()
    sched = MiniScheduler(client, num_blocks, spec.block_size, budget, 64, prefix_caching=prefix)
    order = [2, 3, 4, 5, 0, 1, 6, 7]  # the long shared-prefix prompt first
    for k, i in enumerate(order):
        arrival = 2 * k if staggered else 0
        sched.add(DriverRequest(f"{regime}-{i}", eight_prompts[i], GREEDY, arrival_step=arrival))
    outputs = sched.run()
    if regime == "chunked_prefill":
        assert sched.stats.chunked_steps > 0
    if regime == "prefix_cache":
        assert (
            sched.stats.prefix_hit_tokens >= 3 * 128
        )  # three prompts reuse the first one's blocks
    if regime == "preemption":
        assert sched.stats.preemptions > 0
    for i, expected in enumerate(hf_fp32_greedy):
        got = outputs[f"{regime}-{i}"]
        assert got == expected, (
            f"prompt {i} ({len(eight_prompts[i])} tokens) diverges at {_first_diff(got, expected)}"
        )


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
