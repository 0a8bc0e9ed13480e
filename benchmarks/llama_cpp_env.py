"""llama.cpp beside Tessera: `llama-cpp-python` in its own virtualenv (`.bench/llamacpp`),
installed on first use (it compiles llama.cpp for this CPU: several minutes on 2 cores), and
the subprocess that runs one job in it (benchmarks/llama_cpp_runner.py). Anything that goes
wrong is raised as LlamaCppUnavailable with a plain reason, which the benchmarks report
instead of llama.cpp's figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_venv import BenchVenv, tail

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
    log = env.log_dir / "run.log"
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        argv = [str(env.python), str(RUNNER), str(job_path), str(result_path)]
        try:
            with log.open("w") as out:
                code = subprocess.run(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=environ, timeout=timeout_s
                ).returncode
        except subprocess.TimeoutExpired as exc:
            raise LlamaCppUnavailable(f"llama.cpp run failed: {exc}") from exc
        if code != 0 or not result_path.is_file():
            raise LlamaCppUnavailable(f"llama.cpp run exited {code} (log: {log}): {tail(log)}")
        result: dict[str, Any] = json.loads(result_path.read_text())
        return result
