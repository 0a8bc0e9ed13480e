"""llama.cpp beside Tessera (benchmarks/llama_cpp_env.py): a missing or broken install is
reported with its reason, and benchmarks.quality records that reason instead of a row."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import quality
from benchmarks.llama_cpp_env import LlamaCppUnavailable, run_job
from benchmarks.report import cpu_info


def test_missing_llama_cpp_is_reported_not_installed(tmp_path: Path) -> None:
    with pytest.raises(LlamaCppUnavailable, match=r"llama\.cpp is not installed"):
        run_job({}, tmp_path / "empty", install=False)


def test_failed_install_says_why(tmp_path: Path) -> None:
    blocker = tmp_path / "llamacpp"
    blocker.write_text("a file where the venv should go")
    with pytest.raises(LlamaCppUnavailable, match=r"llama\.cpp install failed: .* -m venv"):
        run_job({}, blocker)


def test_quality_reports_why_llama_cpp_did_not_run(tmp_path: Path) -> None:
    blocker = tmp_path / "llamacpp"
    blocker.write_text("a file where the venv should go")
    args = argparse.Namespace(steps=2, repeats=1, window=8, llama_cpp_venv=blocker)
    row, error = quality.llama_cpp(args, [1, 2, 3])
    assert row == {} and error is not None and "install failed" in error
    text = quality.table(
        {"cpu": cpu_info(), "text_tokens": 3, "window": 8, "new_tokens": 4, "repeats": 1, "steps": 2,
         "rows": [], "llama_cpp_error": error}
    )  # fmt: skip
    assert "not run: llama.cpp install failed" in text
