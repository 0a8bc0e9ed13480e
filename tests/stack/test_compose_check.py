"""The parts of scripts/compose_check.py and compose_image.py that run without a container
engine: how the host's pip settings reach the image build, and the distinct exit code where no
engine can run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.stack import REPO
from scripts.compose_check import NO_ENGINE
from scripts.compose_image import HOST_MOUNT, mount_host_paths, pip_conf, pip_settings


def test_host_paths_move_under_the_mount_and_local_indexes_bring_their_files(
    tmp_path: Path,
) -> None:
    index, wheels, cert = tmp_path / "idx" / "simple", tmp_path / "wheels", tmp_path / "ca.pem"
    index.mkdir(parents=True)
    wheels.mkdir()
    cert.write_text("pem")
    remote, absent = "https://mirror.invalid/simple", str(tmp_path / "absent")
    settings = {
        "global": {"extra-index-url": f"file://{index} {remote}", "cert": str(cert)},
        "install": {"find-links": f"{wheels} {absent}", "timeout": "60"},
    }
    moved, mounts = mount_host_paths(settings)
    assert moved["global"]["extra-index-url"] == f"file://{HOST_MOUNT}{index} {remote}"
    assert moved["global"]["cert"] == f"{HOST_MOUNT}{cert}"
    assert moved["install"] == {"find-links": f"{HOST_MOUNT}{wheels} {absent}", "timeout": "60"}
    assert mounts == sorted([str(index.parent), str(wheels), str(cert)])  # the index's parent


def test_pip_settings_round_trip_through_pip_conf_and_env_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text(
        pip_conf({"global": {"timeout": "5", "retries": "2"}, "install": {"no-compile": "1"}})
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_RETRIES", "9")  # the environment overrides the files, as in pip
    settings = pip_settings()
    assert settings["global"]["timeout"] == "5" and settings["global"]["retries"] == "9"
    assert settings["install"]["no-compile"] == "1"


def test_without_a_container_engine_it_says_so_and_exits_with_its_own_code(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scripts.compose_check", "--no-build"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PATH": str(tmp_path)},  # no podman on PATH
    )
    assert done.returncode == NO_ENGINE, done.stderr
    assert "compose check NOT RUN: no container engine" in done.stderr
