"""vLLM beside Tessera in the benchmarks (issue 11, item 2), without installing vLLM.

The vLLM runs go through a throwaway venv whose `vllm` is tests/benchmarks/fake_vllm.py,
so the venv, subprocess, job and result plumbing is real; the "vLLM unavailable" paths use
empty and broken venvs. CI never installs vLLM.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import decode_bench, offline_bench, run_all
from benchmarks.bench_venv import STAMP
from benchmarks.report import cpu_info
from benchmarks.vllm_env import (
    VLLM_PACKAGE,
    VllmEnv,
    VllmUnavailable,
    ensure_installed,
    run_job,
    serving,
)
from benchmarks.workload import mixed_workload
from tests.conftest import free_port

FAKE = Path(__file__).with_name("fake_vllm.py")


@pytest.fixture(scope="module")
def fake_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv (no pip) with the fake vllm module, stamped as installed."""
    venv = tmp_path_factory.mktemp("bench") / "vllm"
    python = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(python), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "vllm").mkdir()
    shutil.copy(FAKE, site / "vllm" / "__init__.py")
    (venv / STAMP).write_text(VLLM_PACKAGE + "\n")
    return venv


def _calls(venv: Path) -> list[dict]:
    path = next((venv / "lib").glob("python3*/site-packages/vllm/calls.jsonl"))
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    return calls


def test_offline_run_goes_through_vllm_venv(fake_venv: Path) -> None:
    requests = mixed_workload(5, seed=3)
    row = offline_bench.run_vllm(requests, "bfloat16", VllmEnv(fake_venv, kv_cache_gib=3))
    init, warmup, measured = _calls(fake_venv)
    assert init["init"]["dtype"] == "bfloat16" and Path(init["init"]["model"]).is_dir()
    assert init["env"] == {"VLLM_CPU_KVCACHE_SPACE": "3", "HF_HUB_OFFLINE": "1"}
    assert warmup["max_tokens"] == [r.output_len for r in requests[:2]]
    assert measured["prompt_lens"] == [len(r.prompt_token_ids) for r in requests]
    assert measured["max_tokens"] == [r.output_len for r in requests]
    out_tokens = sum(r.output_len for r in requests)
    assert row["engine"] == "vllm" and row["version"] == "0.0-fake"
    assert row["output_tokens_per_s"] * row["elapsed_s"] == pytest.approx(out_tokens)
    assert row["elapsed_s"] >= 0.001 * out_tokens  # the fake sleeps 1 ms per token


def test_decode_run_goes_through_vllm_venv(fake_venv: Path) -> None:
    figures = decode_bench.measure_vllm(VllmEnv(fake_venv), "bfloat16", 6, 1, 4)
    assert set(figures) == {
        "decode_b1_tok_s",
        "decode_b4_tok_s",
        "prefill_512_s",
        "prefill_512_tok_s",
    }
    assert all(v > 0 for v in figures.values())
    assert figures["prefill_512_tok_s"] == pytest.approx(512 / figures["prefill_512_s"])
    calls = _calls(fake_venv)[1:]
    assert {"prompt_lens": [16] * 4, "max_tokens": [7] * 4} in calls  # batch 4, 1 + 6 tokens
    assert {"prompt_lens": [512], "max_tokens": [1]} in calls


def test_missing_vllm_is_reported_not_installed(tmp_path: Path) -> None:
    with pytest.raises(VllmUnavailable, match="not installed"):
        run_job(VllmEnv(tmp_path / "empty", install=False), {"mode": "offline"})


def test_failed_install_says_why_and_is_remembered(tmp_path: Path) -> None:
    blocker = tmp_path / "vllm"
    blocker.write_text("a file where the venv should go")
    with pytest.raises(VllmUnavailable, match=r"vLLM install failed: .* -m venv"):
        ensure_installed(VllmEnv(blocker))
    with pytest.raises(VllmUnavailable, match="install failed"):  # later benches: the reason
        ensure_installed(VllmEnv(blocker, install=False))


def test_broken_vllm_run_is_reported(tmp_path: Path) -> None:
    venv = tmp_path / "vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho 'vllm: broken build' >&2\nexit 3\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / STAMP).write_text(VLLM_PACKAGE + "\n")
    with pytest.raises(VllmUnavailable, match=r"offline run exited 3 .*broken build"):
        offline_bench.run_vllm(mixed_workload(2), "bfloat16", VllmEnv(venv))
    broken = pytest.raises(VllmUnavailable, match=r"server exited 3 .*broken build")
    with broken, serving(VllmEnv(venv), "model", free_port(), timeout_s=30):
        pass


def test_server_without_entrypoint_is_reported(fake_venv: Path) -> None:
    missing = pytest.raises(VllmUnavailable, match=r"server exited 1 .*No module named")
    with missing, serving(VllmEnv(fake_venv), "model", free_port(), timeout_s=30):
        pass


@pytest.mark.parametrize("vllm", ["fake", "missing"])
def test_offline_bench_reports_vllm_or_why_not(
    fake_venv: Path, tmp_path: Path, vllm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """offline_bench.main with vLLM running (the fake) or missing: vLLM's row and ratio, or
    the other engines' figures with the reason. Tessera's own run is stubbed to a 2 s run
    here (it is measured for real by `make bench`; on a loaded 2-core machine it took
    minutes even for 3 requests)."""
    stub = lambda requests, dtype, kv: offline_bench._figures("tessera", requests, 2.0)  # noqa: E731
    monkeypatch.setattr(offline_bench, "run_tessera", stub)
    venv = fake_venv if vllm == "fake" else tmp_path / "empty"
    argv = ["--num-requests", "3", "--skip-hf", "--out-dir", str(tmp_path)]
    data = offline_bench.main([*argv, "--vllm-venv", str(venv), "--no-vllm-install"])
    engines = [r["engine"] for r in data["results"]]
    text = (tmp_path / "offline.md").read_text()
    assert json.loads((tmp_path / "offline.json").read_text()) == data
    if vllm == "fake":
        vllm_s = data["results"][1]["elapsed_s"]
        assert engines == ["tessera", "vllm"]
        assert data["ratios"]["tessera_vs_vllm"] == pytest.approx(vllm_s / 2.0)
        assert f"Tessera / vLLM: **{vllm_s / 2.0:.2f}x**" in text
    else:
        assert engines == ["tessera"] and "not installed" in data["ratios"]["vllm_error"]
        assert "vLLM: not measured (vLLM is not installed in" in text
    assert data["cpu"]["flags"] == cpu_info()["flags"] and cpu_info()["model"] in text
    assert (tmp_path / "offline.png").stat().st_size > 0


def test_run_all_tries_the_install_once(tmp_path: Path) -> None:
    """run_all tries vLLM's install up front; the benches then never retry it and report
    the reason it failed."""
    blocker = tmp_path / "vllm"
    blocker.write_text("a file where the venv should go")
    args = argparse.Namespace(skip=[], vllm_venv=blocker, vllm_kv_cache_gib=3)
    env, argv = run_all.vllm_args(args)
    assert env == VllmEnv(blocker, kv_cache_gib=3, install=False)
    assert argv == ["--vllm-venv", str(blocker), "--vllm-kv-cache-gib", "3", "--no-vllm-install"]
    with pytest.raises(VllmUnavailable, match=r"not installed .*vLLM install failed"):
        ensure_installed(env)
    args.skip = ["vllm"]
    assert run_all.vllm_args(args) == (None, ["--skip-vllm"])


def test_every_benchmark_run_all_runs_takes_its_arguments() -> None:
    """run_all calls benchmarks.<name>.main(argv) for each section: each main takes argv."""
    import importlib
    import inspect
    import re

    names = re.findall(r'run_module\("(\w+)"', inspect.getsource(run_all))
    assert len(names) >= len(run_all.SECTIONS) - 1  # "serve" runs through serve_both
    for name in names:
        main = importlib.import_module(f"benchmarks.{name}").main
        assert len(inspect.signature(main).parameters) == 1, name
