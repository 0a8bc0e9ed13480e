"""benchmarks.lora_bench: its random adapters load as PEFT adapters of the model, its table
states the ratio against the 70% target, and a tiny run writes JSON + Markdown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import lora_bench
from worker_service.lora.weights import load_lora_weights

CPU = {"model": "AMD EPYC", "cpu_class": "AVX2", "cpus": 2, "flags": ["avx2", "fma"]}


def test_random_adapter_is_a_loadable_peft_adapter(tmp_path: Path, default_model_dir: Path) -> None:
    out = lora_bench.write_random_adapter(default_model_dir, tmp_path / "a", rank=8, seed=0)
    weights = load_lora_weights(out, 16, torch.float32)
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert len(weights.pairs) == 7 * cfg["num_hidden_layers"] and weights.rank == 8
    a, b = weights.pairs[(0, "k_proj")]
    assert a.shape == (8, cfg["hidden_size"]) and b.shape == (192, 8)  # 3 KV heads x 64
    assert b.abs().sum() > 0  # scaled, non-zero


def _data(mixed_s: float) -> dict[str, Any]:
    requests = lora_bench.mixed_workload(4, seed=0)
    rows = [
        lora_bench.row(lora_bench.RUNS[0], requests, [10.0, 9.0, 11.0]),
        lora_bench.row(lora_bench.RUNS[1], requests, [10.0, 10.5, 9.5]),
        lora_bench.row(lora_bench.RUNS[2], requests, [mixed_s]),
    ]
    return {"num_requests": 4, "dtype": "bfloat16", "ranks": [8, 16], "repeats": 3, "cpu": CPU,
            "results": rows, "ratios": lora_bench.ratios(rows)}  # fmt: skip


def test_table_states_the_ratio_and_the_target() -> None:
    data = _data(mixed_s=12.5)
    assert data["ratios"] == {"mixed_vs_base": 0.8, "lora_on_base_vs_lora_off": 1.0}
    text = lora_bench.table(data)
    assert "**0.80x** (meets the 70% target)" in text and "AMD EPYC" in text
    assert "(misses the 70% target)" in lora_bench.table(_data(mixed_s=20.0))


@pytest.mark.slow
def test_tiny_run_writes_results(tmp_path: Path) -> None:
    argv = ["--num-requests", "2", "--repeats", "1", "--output-len", "2", "3", "--ranks", "4", "8",
            "--kv-cache-memory", "256MiB", "--out-dir", str(tmp_path)]  # fmt: skip
    data = lora_bench.main(argv)
    assert [r["run"] for r in data["results"]] == list(lora_bench.RUNS)
    assert json.loads((tmp_path / "lora.json").read_text())["ratios"] == data["ratios"]
    assert "Multi-LoRA throughput" in (tmp_path / "lora.md").read_text()
