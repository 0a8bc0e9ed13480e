"""Serving side by side: serve_bench's figures for Tessera and vLLM (same client, same
prompts and rates) in one JSON, one Markdown table with Tessera's ratios, one plot.

run_all writes serve_tessera.* and serve_vllm.* with serve_bench, then `combine` writes
serve.json / serve.md / serve.png from them (vLLM's part may be an error instead). With
Tessera serving the default model's Q4_1 GGUF as shipped (`--quantization gguf`, rate inf
only), its rows join the table with its throughput over the bf16 default's (issue 21's
serving target).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.report import cpu_line, line_plot, markdown_table, ratio, write_results

# (figure, label, lower is better) for the table and the ratios
FIGURES = [
    ("output_throughput", "out tok/s", False),
    ("ttft_ms", "TTFT p50 ms", True),
    ("tpot_ms", "TPOT p50 ms", True),
    ("itl_ms", "ITL p50 ms", True),
    ("e2el_ms", "E2E p50 ms", True),
]


def figure(run: dict[str, Any], key: str) -> float:
    """One figure of one rate: a throughput, or the median of a latency."""
    value = run[key]
    return float(value["median"] if isinstance(value, dict) else value)


def compare(tessera: dict[str, Any], vllm: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per rate Tessera's ratio on each figure (>1: Tessera better), when vLLM ran it too."""
    theirs = {r["request_rate"]: r for r in (vllm or {}).get("runs", [])}
    rows = []
    for run in tessera["runs"]:
        other = theirs.get(run["request_rate"])
        row: dict[str, Any] = {"request_rate": run["request_rate"]}
        for key, _, lower in FIGURES:
            mine = figure(run, key)
            row[key] = None if other is None else ratio(mine, figure(other, key), lower)
        rows.append(row)
    return rows


def combine(
    tessera: dict[str, Any],
    vllm: dict[str, Any] | None,
    vllm_error: str | None,
    cpu: dict[str, Any],
    out_dir: Path,
    tessera_gguf: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write serve.json, serve.md and serve.png from both engines' results (and, when out_dir
    has this run's offline.json, Tessera's serving at rate inf as a share of its offline)."""
    data: dict[str, Any] = {"cpu": cpu, "tessera": tessera, "vllm": vllm}
    data["tessera_vs_vllm"] = compare(tessera, vllm)
    if tessera_gguf is not None:
        data["tessera-gguf"] = tessera_gguf
        data["gguf_inf_vs_bf16"] = ratio(inf_throughput(tessera_gguf), inf_throughput(tessera))
    share = serving_share_of_offline(tessera, out_dir / "offline.json")
    if share is not None:
        data["tessera_inf_share_of_offline"] = share
    if vllm_error is not None:
        data["vllm_error"] = vllm_error
    write_results("serve", data, table(data), out_dir)
    plot(data, out_dir / "serve.png")
    return data


def serving_share_of_offline(tessera: dict[str, Any], offline_json: Path) -> float | None:
    """Tessera's output tok/s at rate inf over its offline figure (None without either)."""
    if not offline_json.is_file():
        return None
    rows = json.loads(offline_json.read_text()).get("results", [])
    offline = next((r["output_tokens_per_s"] for r in rows if r["engine"] == "tessera"), None)
    served = inf_throughput(tessera)
    return None if not offline or served is None else served / offline


def inf_throughput(results: dict[str, Any]) -> float | None:
    """Output tok/s at rate inf (None where it did not run)."""
    runs = [r for r in results["runs"] if math.isinf(r["request_rate"])]
    return figure(runs[0], "output_throughput") if runs else None


def table(data: dict[str, Any]) -> str:
    """One row per engine and rate, then Tessera / vLLM per rate."""
    rows = []
    for engine in ("tessera", "tessera-gguf", "vllm"):
        for run in (data.get(engine) or {}).get("runs", []):
            row: dict[str, Any] = {"engine": engine, "rate (req/s)": str(run["request_rate"])}
            row.update(ok=f"{run['completed']}/{run['num_prompts']}")
            row.update({label: figure(run, key) for key, label, _ in FIGURES})
            rows.append(row)
    text = f"### Online serving (mixed workload, same client and prompts)\n\n{cpu_line(data['cpu'])}\n\n"
    text += markdown_table(rows, ["engine", "rate (req/s)", "ok"] + [f[1] for f in FIGURES])
    ratios = [
        {"rate (req/s)": str(r["request_rate"])}
        | {label: r[key] for key, label, _ in FIGURES if r[key] is not None}
        for r in data["tessera_vs_vllm"]
    ]
    if any(len(r) > 1 for r in ratios):
        text += "\nTessera / vLLM (>1: Tessera better; latencies as vLLM's / Tessera's):\n\n"
        text += markdown_table(ratios, ["rate (req/s)"] + [f[1] for f in FIGURES])
    if "tessera_inf_share_of_offline" in data:
        share = data["tessera_inf_share_of_offline"]
        text += f"\nTessera serving at rate inf / Tessera offline (same run): **{share:.0%}**\n"
    if data.get("gguf_inf_vs_bf16") is not None:
        text += (
            "\nTessera serving the default model's Q4_1 GGUF as shipped (`--quantization gguf`) "
            f"/ the bf16 default, rate inf: **{data['gguf_inf_vs_bf16']:.2f}x**\n"
        )
    if "vllm_error" in data:
        text += f"\nvLLM: not measured ({data['vllm_error']})\n"
    return text


def plot(data: dict[str, Any], path: Path) -> None:
    """TTFT and TPOT p50 against the finite request rates, per engine."""
    series: dict[str, list[float]] = {}
    xs: list[float] = []
    for engine in ("tessera", "vllm"):
        runs = [r for r in (data.get(engine) or {}).get("runs", [])
                if not math.isinf(r["request_rate"])]  # fmt: skip
        if not runs:
            continue
        xs = [r["request_rate"] for r in runs]
        for key in ("ttft_ms", "tpot_ms"):
            series[f"{engine} {key[:4].upper()} p50"] = [figure(r, key) for r in runs]
    if series:
        title = f"Serving latency against request rate\n{cpu_line(data['cpu'])}"
        line_plot(path, title, xs, series, "request rate (req/s)", "ms")
