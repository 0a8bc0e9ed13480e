"""`pip install .` with no extras, from a clean clone into a fresh venv, then `tessera serve`
answers a chat (issue 24, acceptance 4). Catches what only an installed wheel lacks: a runtime
import the dependencies miss, a generated file that exists only in a developer's tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from benchmarks.stack import REPO, start_stack

pytestmark = pytest.mark.slow
NOT_RUNTIME = ["matplotlib", "pytest", "hypothesis", "grpc_tools"]  # the extras' packages


def run(argv: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (argv, done.stdout[-3000:], done.stderr[-3000:])
    return done


def test_a_wheel_with_no_extras_serves_the_default_model(tmp_path: Path) -> None:
    clone, venv = tmp_path / "clone", tmp_path / "venv"
    run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], tmp_path, 120)
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", str(clone)], tmp_path, 1200)
    probe = f"import importlib.util as u; print([m for m in {NOT_RUNTIME} if u.find_spec(m)])"
    assert run([python, "-c", probe], tmp_path, 60).stdout.strip() == "[]"
    stack = start_stack(python=python, cwd=tmp_path)
    try:
        where = run([python, "-c", "import tessera; print(tessera.__file__)"], tmp_path, 60)
        assert str(venv) in where.stdout, where.stdout  # the wheel's code, not the clone's
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
    finally:
        assert stack.stop() == 0, stack.output()[-3000:]
