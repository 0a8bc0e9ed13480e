"""`tessera serve` with the real default model: /metrics exports vLLM's series with vLLM's
types and labels, and their values agree with what the responses reported (issue 24,
item 4 and the metrics half of acceptance 2)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from benchmarks.stack import Stack, start_stack
from tests.gateway.metrics_scrape import (
    PER_REQUEST_HISTOGRAMS,
    check_vllm_series,
    decreased,
    families,
    total,
)
from tests.stack.test_serve_e2e import QUESTION, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = start_stack()
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def run_requests(client: Any, model: str) -> list[tuple[str, Any]]:
    """(finish_reason, usage) of a chat that stops at EOS (twice: the second reuses the
    cached prompt), one cut by max_tokens, and a streamed completion."""
    results = []
    for _ in range(2):
        reply = client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=64
        )
        results.append((reply.choices[0].finish_reason, reply.usage))
    reply = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
    results.append((reply.choices[0].finish_reason, reply.usage))
    stream = client.completions.create(
        model=model, prompt="The sky is", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    reason, usage = None, None
    for chunk in stream:
        reason = next((c.finish_reason for c in chunk.choices if c.finish_reason), reason)
        usage = chunk.usage or usage
    results.append((reason, usage))
    return results


def test_vllm_series_after_real_requests(stack: Stack) -> None:
    client: Any = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    http = httpx.Client(base_url=stack.base_url, timeout=10)
    before = families(http.get("/metrics").text)
    check_vllm_series(before, model, ["0"])
    results = run_requests(client, model)
    reasons = [reason for reason, _ in results]
    assert reasons[:3] == ["stop", "stop", "length"] and reasons[3] in ("stop", "length")
    wait_idle(stack, 5.0)
    after = families(http.get("/metrics").text)
    check_vllm_series(after, model, ["0"])
    assert decreased(before, after) == []

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    usages = [usage for _, usage in results]
    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for reason in ("stop", "length"):
        expected = reasons.count(reason)
        assert delta("vllm:request_success_total", finished_reason=reason) == expected
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    for name in PER_REQUEST_HISTOGRAMS:
        assert delta(f"{name}_count") == len(results), name
    decode_steps = sum(u.completion_tokens - 1 for u in usages)
    assert 0 < delta("vllm:inter_token_latency_seconds_count") <= decode_steps
    assert delta("vllm:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:request_generation_tokens_sum") == sum(u.completion_tokens for u in usages)
    ttft, e2e = (
        delta("vllm:time_to_first_token_seconds_sum"),
        delta("vllm:e2e_request_latency_seconds_sum"),
    )
    assert 0 < ttft < e2e < 120
    assert 0 <= delta("vllm:request_queue_time_seconds_sum") < ttft
    assert 0 < delta("vllm:request_prefill_time_seconds_sum") < ttft
    assert delta("vllm:prefix_cache_queries_total") >= usages[1].prompt_tokens
    assert delta("vllm:prefix_cache_hits_total") > 0  # the repeated chat prompt
    steps = delta("vllm:iteration_tokens_total_count")  # tokens per engine step
    generated = sum(u.completion_tokens for u in usages)
    assert generated <= steps <= 2 * generated  # sequential requests; a pipelined step may run
    scheduled = delta("vllm:iteration_tokens_total_sum")
    assert 0 < scheduled <= sum(u.total_tokens for u in usages) + len(usages)
    assert total(after, "vllm:num_requests_running") == 0
    assert total(after, "vllm:num_requests_waiting") == 0
    assert total(after, "vllm:kv_cache_usage_perc") == 0
    again = families(http.get("/metrics").text)  # scheduler totals re-read: no double count
    assert decreased(after, again) == []
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert total(again, name) == total(after, name)
