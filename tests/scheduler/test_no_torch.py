"""The scheduler imports no torch: it must run where no accelerator stack is installed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import importlib, pkgutil, sys
import scheduler_service
names = [m.name for m in pkgutil.walk_packages(scheduler_service.__path__, "scheduler_service.")]
for name in names:
    importlib.import_module(name)
assert len(names) >= 10, names
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "numpy", "transformers", "triton"})
print(len(names), "modules;", "heavy:", heavy)
sys.exit(1 if heavy else 0)
"""


def test_no_module_of_scheduler_service_imports_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "heavy: []" in result.stdout
