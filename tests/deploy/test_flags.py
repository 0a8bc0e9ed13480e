"""One declaration per flag (issue 24): every flag of the services and of `tessera serve` comes
from one `services.flags.Flag` (a config field's type, default and help), and every flag that
compose.yaml and deploy/kubernetes pass is one of them and builds its service's configs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.__main__ import FLAGS as GATEWAY_FLAGS
from scheduler_service.__main__ import FLAGS as SCHEDULER_FLAGS
from services.flags import FLAG, Flag, flag_name
from tessera import config_doc
from tessera.data_parallel import Topology
from worker_service.__main__ import FLAGS as WORKER_FLAGS

REPO = Path(__file__).resolve().parents[2]
UNDECLARED = {"--runner", "--task"}  # vLLM's pair for one field, declared once in services.pooling
PER_SERVICE = {"--port"}  # each service listens on its own default port: one declaration each
CLASSES = {*config_doc.CONFIGS, *GATEWAY_FLAGS, *SCHEDULER_FLAGS, *WORKER_FLAGS, Topology}


def declarations() -> dict[str, set[int]]:
    """Flag name -> the distinct Flag objects behind it, over every parser."""
    found: dict[str, set[int]] = defaultdict(set)
    for _, build in config_doc.parsers():
        for action in build()._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                found[action.option_strings[0]].add(id(getattr(action, "declaration", None)))
    return found


def test_every_flag_of_every_parser_has_one_declaration() -> None:
    found = declarations()
    undeclared = {name for name, ids in found.items() if id(None) in ids}
    assert undeclared == UNDECLARED
    several = {name for name, ids in found.items() if len(ids) > 1}
    assert several <= PER_SERVICE, several
    assert len(found["--port"]) == 3  # gateway (tessera serve's too), scheduler, worker


def test_each_config_field_with_a_flag_has_one_declaration() -> None:
    by_name: dict[str, set[int]] = defaultdict(set)
    for cls in CLASSES:
        for f in dataclasses.fields(cls):
            if FLAG in f.metadata:
                assert isinstance(f.metadata[FLAG], Flag)
                by_name[flag_name(f)].add(id(f.metadata[FLAG]))
    assert {name for name, ids in by_name.items() if len(ids) > 1} == PER_SERVICE
    assert set(declarations()) - set(by_name) - UNDECLARED == set()  # parsers add only these


def commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, args) of every service compose.yaml and deploy/kubernetes start."""
    found = []
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        command = service["command"]
        assert command[:2] == ["python", "-m"], command
        if command[2] == "tessera":  # `tessera engine` takes `tessera serve`'s flags
            assert command[3] == "engine", command
            command = command[:3] + command[4:]
        found.append((f"compose {name}", command[2], command[3:]))
    for path in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    found.append((f"{path.name} {c['name']}", c["command"][2], c["args"]))
    return found


def _interpolated(arg: str) -> str:
    """A compose `${VAR:-default}` as its default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg)


def _parser(module: str) -> argparse.ArgumentParser:
    if module == "tessera":
        return config_doc.serve_parser()
    return importlib.import_module(f"{module}.__main__").build_parser()


def _configs(module: str, args: argparse.Namespace) -> Any:
    """What the service builds from its flags at start (ValueError on a bad value)."""
    if module == "tessera":
        from tessera.cli import build_services

        return build_services(args, "token")
    main = importlib.import_module(f"{module}.__main__")
    build = {"gateway": "config_from_args", "scheduler_service": "configs"}
    return getattr(main, build.get(module, "build_config"))(args)


@pytest.mark.parametrize(("where", "module", "argv"), commands(), ids=lambda v: str(v)[:40])
def test_deployed_flags_are_declared_and_build_the_configs(
    where: str, module: str, argv: list[str]
) -> None:
    parser = _parser(module)
    args = [_interpolated(a) for a in argv]
    given = parser.parse_args(args)
    assert _configs(module, given), where
    for arg in args:
        if arg.startswith("--"):
            action = parser._option_string_actions[arg.split("=", 1)[0]]
            assert getattr(action, "declaration", None) is not None, (where, arg)


@pytest.mark.parametrize(("where", "module", "argv"), commands(), ids=lambda v: str(v)[:40])
def test_compose_variable_defaults_are_the_declared_defaults(
    where: str, module: str, argv: list[str]
) -> None:
    """`--max-num-seqs=${TESSERA_MAX_NUM_SEQS:-256}`: unset, the service's own default."""
    parser = _parser(module)
    for arg in argv:
        match = re.fullmatch(r"(--[\w-]+)=\$\{\w+:-([^}]*)\}", arg)
        if match:
            spec = parser._option_string_actions[match[1]].declaration  # type: ignore[attr-defined]
            text = match[2]
            value = spec.parse(text) if spec.parse else type(spec.default)(text)
            assert value == spec.default, (where, arg)
