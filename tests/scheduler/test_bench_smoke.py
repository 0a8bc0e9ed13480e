"""The scheduler benchmark runs and writes its JSON and Markdown results."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import scheduler_bench


def test_scheduler_bench_writes_results(tmp_path: Path) -> None:
    scheduler_bench.main(["--steps", "20", "--repeat", "1", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "scheduler.json").read_text())
    scenarios = [r["scenario"] for r in data["results"]]
    assert scenarios == ["256 running decode", "64 mixed prefill/decode"]
    assert all(r["steps"] == 20 and r["median_ms"] > 0 for r in data["results"])
    assert "| 256 running decode |" in (tmp_path / "scheduler.md").read_text()
