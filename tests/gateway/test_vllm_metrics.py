"""The vllm:* series: vLLM's names, types, labels and buckets; scheduler totals as counters
that never go back (restarts, several replicas); per-request figures from a fake-engine
gateway driven by the official openai client, per replica (issue 24, item 4)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from gateway.metrics import GatewayMetrics
from gateway.vllm_metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    RunningTotals,
    build_1_2_5_buckets,
)
from services.iteration_tokens import TokenHistogram, add_counts
from services.step_types import SchedulerStats
from services.types import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    RequestTimestamps,
    SamplingParams,
)
from tests.gateway.conftest import API_KEY, Stack
from tests.gateway.fake_engine import MODEL_NAME
from tests.gateway.metrics_scrape import (
    PER_REQUEST_HISTOGRAMS,
    check_vllm_series,
    decreased,
    families,
    total,
)


def scrape(metrics: GatewayMetrics) -> dict[str, Any]:
    return families(metrics.render().decode())


def stats(steps: int, preemptions: int, queries: int = 0, hits: int = 0) -> SchedulerStats:
    return SchedulerStats(
        num_running=1, num_waiting=2, kv_cache_usage=0.5, num_steps=steps,
        num_preemptions=preemptions, prefix_cache_queries=queries, prefix_cache_hits=hits,
    )  # fmt: skip


def test_buckets_are_vllms() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048)[-1] == 2000
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0 and len(ITL_BUCKETS) == 19
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    m = GatewayMetrics()
    m.bind_model("m", 100)
    text = m.render().decode()
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="100.0",model_name="m"}' in text


def test_running_totals_never_go_back() -> None:
    totals = RunningTotals()
    assert totals.increment("a", "x", 5, False) == 5  # first sight: all of it
    assert totals.increment("a", "x", 8, False) == 3
    assert totals.increment("b", "x", 2, False) == 2  # each source on its own
    assert totals.increment("a", "x", 4, False) == 4  # went down: restarted, all new
    assert totals.increment("a", "x", 9, True) == 9  # restart told by the step count


def test_scheduler_counters_survive_restarts_and_replicas() -> None:
    m = GatewayMetrics()
    m.bind_model("m", 64)
    m.set_replica_stats([("a:1", stats(10, 3, 100, 40)), ("b:1", stats(5, 1))])
    m.set_replica_stats([("a:1", stats(20, 4, 150, 60)), ("b:1", None)])  # b did not answer
    first = scrape(m)
    assert total(first, "vllm:num_preemptions_total", engine="0") == 4
    assert total(first, "vllm:num_preemptions_total", engine="1") == 1
    assert total(first, "vllm:prefix_cache_hits_total", engine="0") == 60
    assert total(first, "vllm:num_requests_waiting", engine="1") == 2  # its last answer
    # a restarted (steps back to 2) with preemptions 1 < 4 and queries 30 > 0
    m.set_replica_stats([("a:1", stats(2, 1, 30, 10)), ("b:1", stats(6, 1))])
    second = scrape(m)
    assert total(second, "vllm:num_preemptions_total", engine="0") == 5
    assert total(second, "vllm:prefix_cache_queries_total", engine="0") == 180
    assert total(second, "vllm:num_preemptions_total", engine="1") == 1
    assert decreased(first, second) == []
    m.set_replica_stats([("b:1", stats(7, 2))])  # a left DNS: its gauges go, counters stay
    third = scrape(m)
    engines = {s.labels["engine"] for s in third["vllm:num_requests_running"].samples}
    assert engines == {"1"} and decreased(second, third) == []
    assert total(third, "tessera_scheduler_preemptions") == 2  # Tessera's gauges: the sum


def test_one_request_fills_every_series() -> None:
    m = GatewayMetrics()
    m.bind_model("m", 64)
    params = SamplingParams(max_tokens=3)
    tracker = m.track_request(EngineCoreRequest("r", [1, 2, 3, 4], params, time.time() - 0.5))
    stamps = RequestTimestamps(queued=100.0, scheduled=100.25, first_token=101.0)
    tracker.on_output(EngineCoreOutput("r", [7], timestamps=stamps), "a:1")
    tracker.on_output(EngineCoreOutput("r", [8, 9], finish_reason=FinishReason.LENGTH), "a:1")
    tracker.finish("length")
    tracker.finish("abort")  # only the first finish counts
    s = scrape(m)
    assert total(s, "vllm:prompt_tokens_total") == 4
    assert total(s, "vllm:generation_tokens_total") == 3
    assert total(s, "vllm:request_success_total", finished_reason="length") == 1
    assert total(s, "vllm:request_success_total", finished_reason="abort") == 0
    for name in PER_REQUEST_HISTOGRAMS:
        assert total(s, f"{name}_count") == 1, name
    assert total(s, "vllm:inter_token_latency_seconds_count") == 1
    assert total(s, "vllm:request_queue_time_seconds_sum") == 0.25
    assert total(s, "vllm:request_prefill_time_seconds_sum") == 0.75
    assert total(s, "vllm:e2e_request_latency_seconds_sum") >= 0.5
    assert total(s, "vllm:request_params_max_tokens_sum") == 3


def test_refused_request_is_not_counted() -> None:
    m = GatewayMetrics()
    m.bind_model("m", 64)
    tracker = m.track_request(EngineCoreRequest("r", [1], SamplingParams(), time.time()))
    tracker.finish(None)
    tracker.finish("abort")
    s = scrape(m)
    assert total(s, "vllm:request_success_total") == 0
    assert total(s, "vllm:e2e_request_latency_seconds_count") == 0


def test_iteration_tokens_from_bucket_totals() -> None:
    steps = TokenHistogram()
    for n in (1, 8, 9, 20000):
        steps.observe(n)
    assert steps.counts[:3] == [1, 1, 1] and steps.counts[-1] == 1 and steps.sum == 20018
    assert add_counts([[1, 2], [], [3, 4, 5]]) == [4, 6, 5]
    m = GatewayMetrics()
    m.bind_model("m", 64)
    first = SchedulerStats(num_steps=4, iteration_tokens_sum=steps.sum)
    first.iteration_tokens_bucket_counts = steps.counts
    restarted = SchedulerStats(num_steps=1, iteration_tokens_sum=5)
    restarted.iteration_tokens_bucket_counts = [0, 1]  # one step of 5 tokens since the restart
    m.set_replica_stats([("a:1", first)])
    m.set_replica_stats([("a:1", restarted)])
    s = scrape(m)
    assert total(s, "vllm:iteration_tokens_total_count") == 5
    assert total(s, "vllm:iteration_tokens_total_sum") == 20023
    assert total(s, "vllm:iteration_tokens_total_bucket", le="8.0") == 3
    assert total(s, "vllm:iteration_tokens_total_bucket", le="+Inf") == 5


@pytest.fixture(scope="module")
def stack(stack_dp: Stack) -> Stack:
    return stack_dp


@pytest.mark.slow
def test_fake_engine_requests_reach_the_vllm_series(stack: Stack) -> None:
    replicas = len(stack.engine_servers)
    client: Any = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY)
    http = httpx.Client(base_url=stack.base_url)
    before = families(http.get("/metrics").text)
    messages: Any = [{"role": "user", "content": "hi"}]
    usages = []
    for i in range(4):  # the fake answers ~20 tokens then EOS: max_tokens 200 stops, 5 is length
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=200 if i % 2 else 5
        )
        usages.append(reply.usage)
    stream = client.completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=200, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    after = families(http.get("/metrics").text)
    again = families(http.get("/metrics").text)
    engines = [str(i) for i in range(replicas)]
    check_vllm_series(after, MODEL_NAME, engines)
    assert decreased(before, after) == [] and decreased(after, again) == []

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("vllm:request_success_total", finished_reason="stop") == 3
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    for name in PER_REQUEST_HISTOGRAMS:
        assert delta(f"{name}_count") == 5, name
    # the fake reports the same 7 preemptions at every scrape: each replica counts them once
    assert total(again, "vllm:num_preemptions_total") == 7 * replicas
    assert total(again, "vllm:num_requests_running") == 3 * replicas
