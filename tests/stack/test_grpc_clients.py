"""The gRPC client examples (Python, Node, Java) against one real `tessera serve` stack with the
default model: each streams a chat with n=2 and logprobs, gets an answer constrained to a JSON
schema and a forced tool call, and prints a JSON summary checked here (issue 24, acceptance 3).
A test skips only where its toolchain is missing, and says what is missing."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from benchmarks.stack import REPO, Stack, start_stack

pytestmark = pytest.mark.slow
CLIENTS = REPO / "examples" / "clients"
DEBIAN_REPO = Path("/usr/share/maven-repo")  # where Debian installs Java libraries' jars and poms
_POM = "{http://maven.apache.org/POM/4.0.0}"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = start_stack()  # the defaults: bf16, default model
    yield stack
    assert stack.stop() == 0, stack.output()[-3000:]


def example_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """SCHEMA and WEATHER_ARGS of the Python example (the three examples use the same)."""
    spec = importlib.util.spec_from_file_location(
        "tessera_client", CLIENTS / "python" / "client.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines only: main() runs as __main__
    return module.SCHEMA, module.WEATHER_ARGS


def check_summary(summary: dict[str, Any]) -> None:
    """n=2 choices with logprobs, a JSON answer valid under the schema, a parsed tool call."""
    schema, weather_args = example_schemas()
    choices = summary["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        assert choice["text"] and choice["finish_reason"] in ("stop", "length")
        assert choice["logprobs"], choice
        for entry in choice["logprobs"]:
            token = entry.get("token", "")  # Java's JSON printer leaves out "" and 0
            assert entry.get("logprob", 0.0) <= 0 and isinstance(token, str)
            raw = entry.get("bytes", [])
            if isinstance(raw, list) and "\ufffd" not in token:  # Java prints base64
                assert bytes(raw) == token.encode()
    jsonschema.validate(summary["json"], schema)
    call = summary["tool_call"]
    assert call["name"] == "get_weather" and call["finish_reason"] == "tool_calls"
    assert call["id"].startswith("call_")
    jsonschema.validate(call["arguments"], weather_args)


def last_json_line(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_python_client(stack: Stack) -> None:
    done = subprocess.run(
        [sys.executable, "client.py", "--gateway", stack.gateway_grpc_address],
        cwd=CLIENTS / "python", capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    summary = last_json_line(done)
    check_summary(summary)
    assert summary["usage"]["completion"] == sum(len(c["logprobs"]) for c in summary["choices"])
    assert "choice 1 (" in done.stdout and "tool call (tool_calls): get_weather(" in done.stdout


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node (not on PATH)")
def test_node_client(stack: Stack) -> None:
    client_dir = CLIENTS / "node"
    if not (client_dir / "node_modules" / "@grpc" / "grpc-js").is_dir():
        if shutil.which("npm") is None:
            pytest.skip("needs @grpc/grpc-js in examples/clients/node/node_modules, or npm")
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--no-package-lock"],
            cwd=client_dir, check=True, timeout=300,
        )  # fmt: skip
    done = subprocess.run(
        ["node", "client.js", "--gateway", stack.gateway_grpc_address, "--scheduler", stack.scheduler_address],
        cwd=client_dir, capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "TESSERA_INTERNAL_TOKEN": stack.internal_token},
    )  # fmt: skip
    result = last_json_line(done)
    assert "Paris" in result["answer"]
    assert result["server_info"]["model_name"] == "SmolLM2-135M-Instruct"
    assert result["server_info"]["num_blocks"] > 0
    check_summary(result)


def java_toolchain_missing(pom: Path) -> list[str]:
    """What the offline Java build lacks: the JDK and Maven, protoc and the grpc-java code
    generator the pom runs, and the dependencies and plugins it names in Debian's repository."""
    missing = [tool for tool in ("java", "javac", "mvn") if shutil.which(tool) is None]
    root = ET.parse(pom).getroot()
    props = {p.tag.removeprefix(_POM): p.text or "" for p in root.find(f"{_POM}properties") or []}
    missing += [
        props[tool] for tool in ("protoc", "grpc.java.plugin") if not Path(props[tool]).is_file()
    ]
    for node in [*root.iter(f"{_POM}dependency"), *root.iter(f"{_POM}plugin")]:
        if node.findtext(f"{_POM}executions/{_POM}execution/{_POM}phase") == "none":
            continue  # unbound: Maven never resolves it
        group, artifact, version = (
            re.sub(r"\$\{([\w.]+)\}", lambda m: props[m[1]], node.findtext(f"{_POM}{k}") or "")
            for k in ("groupId", "artifactId", "version")
        )
        if not (DEBIAN_REPO / Path(*group.split(".")) / artifact / version).is_dir():
            missing.append(f"{group}:{artifact}:{version} in {DEBIAN_REPO}")
    return missing


def test_java_client(request: pytest.FixtureRequest) -> None:
    client_dir = CLIENTS / "java"
    missing = java_toolchain_missing(client_dir / "pom.xml")
    if missing:  # checked before the stack starts
        pytest.skip(
            f"the Java example builds offline from Debian packages; missing: {', '.join(missing)}. "
            "`bash scripts/install_java_client.sh` (as root; `make test` runs it) installs them"
        )
    stack: Stack = request.getfixturevalue("stack")
    build = subprocess.run(  # .mvn/maven.config: -o reads file://, local repo target/m2
        ["mvn", "-o", "-q", "-B", "package"], cwd=client_dir, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-2000:]
    done = subprocess.run(
        ["java", "-jar", "target/tessera-client.jar", "--gateway", stack.gateway_grpc_address],
        cwd=client_dir, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    check_summary(last_json_line(done))
