"""The benchmark reports with and without vLLM: CPU line, ratios, tables, JSON, plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import decode_bench, offline_bench, serve_compare
from benchmarks.report import cpu_info, cpu_line, ratio, write_results

AMX_CPU = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8
"""
AVX2_CPU = "processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx avx2 fma\n"
CPUS = len(os.sched_getaffinity(0))
CPU = {"model": "Intel(R) Xeon(R) Platinum 8480+", "cpu_class": "AMX", "cpus": 2,
       "flags": ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                 "amx_tile", "amx_bf16", "amx_int8"]}  # fmt: skip


def _cpu(text: str, tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return cpu_info(path)


def test_cpu_info_names_model_class_and_flags(tmp_path: Path) -> None:
    assert _cpu(AMX_CPU, tmp_path) == {**CPU, "cpus": CPUS}
    avx2 = _cpu(AVX2_CPU, tmp_path)
    assert (avx2["cpu_class"], avx2["flags"]) == ("AVX2", ["avx2", "fma"])
    assert _cpu("", tmp_path)["cpu_class"] == "other"
    assert f"AMD EPYC 7B12, {CPUS} CPUs, class AVX2 (avx2 fma)" in cpu_line(avx2)
    here = cpu_info()  # this machine's /proc/cpuinfo
    assert here["cpus"] >= 1 and here["model"] != "unknown CPU"


def test_ratio_is_tessera_over_the_other() -> None:
    assert ratio(200.0, 100.0) == 2.0  # throughput: higher is better
    assert ratio(10.0, 40.0, lower_is_better=True) == 4.0  # time: lower is better
    assert ratio(1.0, None) is None and ratio(0.0, 1.0) is None


def _offline_rows(with_vllm: bool) -> list[dict[str, Any]]:
    rows = [{"engine": "tessera", "elapsed_s": 20.0, "output_tokens_per_s": 450.0},
            {"engine": "hf-static", "elapsed_s": 100.0, "output_tokens_per_s": 90.0}]  # fmt: skip
    if with_vllm:
        rows.append({"engine": "vllm", "elapsed_s": 50.0, "output_tokens_per_s": 180.0})
    return rows


def _offline_data(with_vllm: bool, error: str | None = None) -> dict[str, Any]:
    rows = _offline_rows(with_vllm)
    return {"num_requests": 64, "dtype": "bfloat16", "hf_dtype": "bfloat16", "cpu": CPU,
            "results": rows, "ratios": offline_bench.compare(rows, error)}  # fmt: skip


def test_offline_with_vllm(tmp_path: Path) -> None:
    data = _offline_data(with_vllm=True)
    assert data["ratios"] == {"tessera_vs_hf-static": 5.0, "tessera_vs_vllm": 2.5}
    text = offline_bench.table(data)
    assert "Tessera / HF static batching: **5.00x**" in text
    assert "Tessera / vLLM: **2.50x**" in text and "| vllm | 50.00 |" in text
    assert cpu_line(CPU) in text and "not measured" not in text
    offline_bench.plot(data, tmp_path / "offline.png")
    assert (tmp_path / "offline.png").stat().st_size > 0


def test_offline_without_vllm_says_why() -> None:
    data = _offline_data(with_vllm=False, error="vLLM install failed: no wheel")
    assert data["ratios"] == {
        "tessera_vs_hf-static": 5.0,
        "vllm_error": "vLLM install failed: no wheel",
    }
    text = offline_bench.table(data)
    assert "Tessera / HF static batching: **5.00x**" in text and "Tessera / vLLM" not in text
    assert "vLLM: not measured (vLLM install failed: no wheel)" in text


def _decode_results(**engines: Any) -> dict[str, Any]:
    return {"dtype": "bfloat16", "threads": 2, "repeats": 3, "batch": 32, "cpu": CPU, **engines}


FIGS = {"decode_b1_tok_s": 150.0, "decode_b32_tok_s": 1200.0, "prefill_512_s": 0.2}


def test_decode_table_with_and_without_vllm(tmp_path: Path) -> None:
    hf = {"decode_b1_tok_s": 50.0, "decode_b32_tok_s": 400.0, "prefill_512_s": 0.4}
    vllm = {"decode_b1_tok_s": 100.0, "decode_b32_tok_s": 600.0, "prefill_512_s": 0.1}
    both = decode_bench.table(_decode_results(tessera=FIGS, hf_transformers=hf, vllm=vllm))
    rows = {line.split(" | ")[0]: line for line in both.splitlines() if line.startswith("| ")}
    assert rows["| decode_b1_tok_s"].endswith("| 150.00 | 50.00 | 100.00 | 3.00 | 1.50 |")
    assert rows["| decode_b32_tok_s"].endswith("| 3.00 | 2.00 |")
    assert rows["| prefill_512_s"].endswith("| 2.00 | 0.50 |")  # time: other / Tessera
    assert cpu_line(CPU) in both
    decode_bench.plot(_decode_results(tessera=FIGS, vllm=vllm), tmp_path / "decode.png")
    assert (tmp_path / "decode.png").stat().st_size > 0
    results = _decode_results(tessera=FIGS, hf_transformers=hf, vllm_error="vLLM run exited 1")
    alone = decode_bench.table(results)
    assert "| decode_b1_tok_s | 150.00 | 50.00 |  | 3.00 |  |" in alone
    assert "vLLM: not measured (vLLM run exited 1)" in alone


def _serve(out_tok_s: float, ttft: float, tpot: float) -> dict[str, Any]:
    def run(rate: float) -> dict[str, Any]:
        lat = lambda v: {"mean": v, "median": v, "p99": v}  # noqa: E731
        return {"request_rate": rate, "num_prompts": 8, "completed": 8, "output_throughput": out_tok_s,
                "ttft_ms": lat(ttft), "tpot_ms": lat(tpot), "itl_ms": lat(tpot), "e2el_ms": lat(9 * tpot)}  # fmt: skip

    return {"runs": [run(math.inf), run(1.0), run(2.0)]}


def test_serving_side_by_side(tmp_path: Path) -> None:
    data = serve_compare.combine(_serve(300, 50, 10), _serve(100, 100, 40), None, CPU, tmp_path)
    assert "tessera_inf_share_of_offline" not in data  # no offline.json in this run
    assert {p.name for p in tmp_path.iterdir()} == {"serve.json", "serve.md", "serve.png"}
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["cpu"] == CPU and "vllm_error" not in saved
    first = data["tessera_vs_vllm"][0]
    assert first["output_throughput"] == 3.0 and first["ttft_ms"] == 2.0 and first["tpot_ms"] == 4.0
    text = (tmp_path / "serve.md").read_text()
    assert "| tessera | inf | 8/8 | 300.00 | 50.00 | 10.00 |" in text
    assert "| vllm | 2.0 | 8/8 | 100.00 | 100.00 | 40.00 |" in text
    assert "| 1.0 | 3.00 | 2.00 | 4.00 | 4.00 | 4.00 |" in text and cpu_line(CPU) in text


def test_serving_without_vllm(tmp_path: Path) -> None:
    data = serve_compare.combine(_serve(300, 50, 10), None, "vLLM server exited 1", CPU, tmp_path)
    assert all(r["output_throughput"] is None for r in data["tessera_vs_vllm"])
    text = serve_compare.table(data)
    assert "| tessera | inf |" in text and "| vllm |" not in text and "Tessera / vLLM" not in text
    assert "vLLM: not measured (vLLM server exited 1)" in text


@pytest.mark.parametrize("with_vllm", [True, False])
def test_written_json_keeps_every_figure(tmp_path: Path, with_vllm: bool) -> None:
    data = _offline_data(with_vllm, None if with_vllm else "left out")
    path = write_results("offline", data, offline_bench.table(data), tmp_path)
    assert json.loads(path.read_text()) == data


def test_serving_share_of_offline(tmp_path: Path) -> None:
    offline = _offline_data(with_vllm=True)
    write_results("offline", offline, offline_bench.table(offline), tmp_path)  # Tessera: 450
    data = serve_compare.combine(_serve(360, 50, 10), None, "left out", CPU, tmp_path)
    assert data["tessera_inf_share_of_offline"] == pytest.approx(0.8)
    assert (
        "Tessera serving at rate inf / Tessera offline (same run): **80%**"
        in (tmp_path / "serve.md").read_text()
    )


def test_serving_from_the_gguf_joins_the_table_with_its_ratio(tmp_path: Path) -> None:
    gguf = {"runs": [r for r in _serve(390, 60, 9)["runs"] if math.isinf(r["request_rate"])]}
    data = serve_compare.combine(_serve(300, 50, 10), None, "left out", CPU, tmp_path, gguf)
    assert data["gguf_inf_vs_bf16"] == pytest.approx(1.3)
    text = (tmp_path / "serve.md").read_text()
    assert "| tessera-gguf | inf | 8/8 | 390.00 | 60.00 | 9.00 |" in text
    assert "| tessera-gguf | 1.0 |" not in text
    assert "/ the bf16 default, rate inf: **1.30x**" in text
    assert "gguf_inf_vs_bf16" not in serve_compare.combine(
        _serve(300, 50, 10), None, "left out", CPU, tmp_path
    )
