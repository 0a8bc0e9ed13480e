"""Run a test file's Triton kernel cases in a child pytest under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_under_interpreter(test_file: str, child_flag: str, num_tests: int) -> None:
    """The child must pass exactly `num_tests` tests (so none is silently skipped)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", child_flag: "1"}
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.match(rf"{num_tests} passed in ", summary), report
