"""Reading /metrics in tests: parse a scrape with prometheus_client's parser, check the
vllm:* series against what vLLM V1 exports, compare two scrapes."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# family name (as the parser reports it: counters without _total) -> type, as vLLM exports it
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}
# histograms observed once per finished request
PER_REQUEST_HISTOGRAMS = [
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_time_per_output_token_seconds",
    "vllm:time_to_first_token_seconds",
]
Sample = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(scrape: dict[str, Metric]) -> dict[Sample, float]:
    """Every sample of a scrape by (name, labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in scrape.values()
        for s in family.samples
    }


def check_vllm_series(scrape: dict[str, Metric], model_name: str, engines: Iterable[str]) -> None:
    """Each vLLM series is there with its type and labels model_name and engine."""
    wanted_engines = set(engines)
    for name, kind in VLLM_SERIES.items():
        family = scrape.get(name)
        assert family is not None, f"{name} is missing"
        assert family.type == kind, f"{name} is a {family.type}, not a {kind}"
        assert family.samples, f"{name} has no samples"
        for s in family.samples:
            assert s.labels["model_name"] == model_name, (name, s.labels)
            wanted = {"model_name", "engine", "le"} | {"finished_reason"}
            assert set(s.labels) <= wanted, (name, s.labels)
        seen = {s.labels["engine"] for s in family.samples}
        assert seen == wanted_engines, (name, seen)
    reasons = {s.labels["finished_reason"] for s in scrape["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    for s in scrape["vllm:kv_cache_usage_perc"].samples:
        assert 0.0 <= s.value <= 1.0


def total(scrape: dict[str, Metric], sample_name: str, **labels: str) -> float:
    """Sum of the samples named `sample_name` whose labels include `labels` (all engines)."""
    family_name = sample_name
    for suffix in ("_total", "_count", "_sum", "_bucket"):
        family_name = family_name.removesuffix(suffix)
    family = scrape[family_name]
    return sum(
        s.value
        for s in family.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def decreased(
    before: dict[str, Metric], after: dict[str, Metric], prefix: str = "vllm:"
) -> list[Sample]:
    """The counter and histogram samples (not _created) named `prefix`... that went down from
    one scrape to the next, or vanished."""
    new = samples(after)
    bad = []
    for name, family in before.items():
        if not name.startswith(prefix) or family.type not in ("counter", "histogram"):
            continue
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            if not s.name.endswith("_created") and (key not in new or new[key] < s.value):
                bad.append(key)
    return bad
