"""deploy/grafana/tessera-dashboard.json (issue 24, item 4): every series a panel or variable
queries is one the gateway exports, every label it groups or filters by is on that series,
and the dashboard is well formed (unique panel ids, templated data source)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from services.step_types import SchedulerStats
from services.types import EngineCoreOutput, EngineCoreRequest, RequestTimestamps, SamplingParams

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tessera-dashboard.json"
SERIES = re.compile(r"\b((?:vllm:|tessera_)[A-Za-z0-9_:]*)")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
MATCHERS = re.compile(r"\{([^}]*)\}")


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, of a gateway that served one request."""
    metrics = GatewayMetrics()
    metrics.bind_model("m", 2048)
    metrics.http_requests.labels(route="/v1/completions", status="200").inc()
    tracker = metrics.track_request(EngineCoreRequest("r", [1, 2], SamplingParams(), time.time()))
    tracker.on_output(EngineCoreOutput("r", [3], timestamps=RequestTimestamps(1, 2, 3)), "a:1")
    tracker.finish("stop")
    metrics.set_replica_stats([("a:1", SchedulerStats(num_steps=1))])
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def test_every_queried_series_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported()
    exprs = queries(dashboard)
    queried = {name for expr in exprs for name in SERIES.findall(expr)}
    assert queried - set(names) == set()
    for expr in exprs:
        series = SERIES.findall(expr)
        labels = {x.strip() for group in GROUPING.findall(expr) for x in group.split(",")}
        labels |= {m.split("=")[0].strip() for g in MATCHERS.findall(expr) for m in g.split(",")}
        labels -= {"le", ""}
        for name in series:
            assert labels <= names[name] | {"le"}, (expr, name, labels - names[name])
    wanted = {
        "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
    }  # fmt: skip
    assert wanted <= queried


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])
        for target in panel["targets"]:
            if "vllm:" in target["expr"]:
                assert '$model_name"' in target["expr"], target["expr"]
