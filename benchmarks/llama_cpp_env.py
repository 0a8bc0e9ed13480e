"""llama.cpp beside Tessera: `llama-cpp-python` in its own virtualenv (`.bench/llamacpp`),
installed on first use (it compiles llama.cpp for this CPU: several minutes on 2 cores), and
the subprocess that runs one job in it (benchmarks/llama_cpp_runner.py). Anything that goes
wrong is raised as LlamaCppUnavailable with a plain reason, which the benchmarks report
instead of llama.cpp's figures.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from benchmarks.bench_venv import BenchVenv

LLAMA_CPP_PACKAGE = "llama-cpp-python==0.3.36"
DEFAULT_VENV = Path(".bench/llamacpp")
RUNNER = Path(__file__).with_name("llama_cpp_runner.py")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp could not be installed or run; the message says why."""


def installer(venv: Path = DEFAULT_VENV) -> BenchVenv:
    return BenchVenv(venv, LLAMA_CPP_PACKAGE, "llama.cpp", "import llama_cpp", LlamaCppUnavailable)


def run_job(
    job: dict[str, Any], venv: Path = DEFAULT_VENV, install: bool = True, timeout_s: float = 1800
) -> dict[str, Any]:
    """Run one job (see llama_cpp_runner.py) in llama.cpp's venv; returns its result dict."""
    env = installer(venv)
    env.ensure(install)
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env.run_job(RUNNER, job, "decode", environ, timeout_s)
