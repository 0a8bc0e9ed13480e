"""The step-overhead benchmark drives the real services in three processes and writes results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import step_overhead_bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_step_overhead_bench_measures_every_part(tmp_path: Path) -> None:
    step_overhead_bench.main(
        ["--running", "4", "--steps", "30", "--repeat", "1", "--out-dir", str(tmp_path)]
    )
    result = json.loads((tmp_path / "step_overhead.json").read_text())["results"]["4"]
    assert result["steps"] == 30
    parts = result["parts"]
    for part in ("schedule", "encode", "worker_convert", "decode", "update"):
        assert parts[part]["median_ms"] > 0, part
    assert parts["transport"]["median_ms"] >= 0  # async: the reply may be back already
    assert parts["total"]["median_ms"] >= parts["update"]["median_ms"]
    assert result["delivery"]["tokens_received"] >= 4 * 30  # the streams carried the tokens
    assert "TOTAL per-step overhead" in (tmp_path / "step_overhead.md").read_text()
    assert (tmp_path / "step_overhead.png").stat().st_size > 0
