"""benchmarks.moe_bench at a tiny size: both paths run, agree, and the results are written."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import moe_bench


def test_moe_bench_writes_side_by_side_results(tmp_path: Path) -> None:
    argv = ["--hidden", "32", "--intermediate", "16", "--experts", "4", "--batches", "1", "5",
            "--repeats", "2", "--out-dir", str(tmp_path)]  # fmt: skip
    data = moe_bench.main(argv)
    rows = data["rows"]
    assert [(r["dtype"], r["batch"]) for r in rows] == [
        ("float32", 1), ("float32", 5), ("bfloat16", 1), ("bfloat16", 5),
        ("bfloat16-f32", 1), ("bfloat16-f32", 5)]  # fmt: skip
    assert all(r["fused_ms"] > 0 and r["per_token_ms"] > 0 for r in rows)
    assert all(r["max_abs_diff"] < (1e-5 if r["dtype"] == "float32" else 0.1) for r in rows)
    saved = json.loads((tmp_path / "moe.json").read_text())
    assert saved["cpu"]["model"] and saved["shape"]["experts"] == 4
    table = (tmp_path / "moe.md").read_text()
    assert "| dtype | batch | fused_ms | per_token_ms | speedup |" in table and "CPU: " in table
