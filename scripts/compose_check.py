"""Run compose.yaml for real with podman and prove the stack recovers by itself (issue 14).

`make compose-check` (`python -m scripts.compose_check`) builds the image from the Dockerfile
(the host's pip settings go in as the build secret `pipconf`), brings the stack up with
podman-compose, waits for health, chats through the published gateway port with the `openai`
client, checks that only the gateway publishes ports and that the engine refuses a call without
the internal token, then SIGKILLs the engine container's main process, the gateway container's
main process and the worker inside the engine container, timing each until the stack answers a
new request again with no human help; last, it scales the running stack to `--engines` engine
replicas, checks that each finishes some of a dozen distinct prompts sent to the one gateway,
and kills the gateway once more (it must start again while `engine` has several addresses).
Writes bench-results/compose_check.{json,md}; exits 1 on a failed check and 3 where no container
engine or compose tool can run (not part of CI).

A crash is a SIGKILL sent from the host to the container's main process: `podman kill`, like
`docker kill`, disables the restart policy until the container is next started.

Podman-only workarounds (Docker does these by itself):
- podman 4.3 runs healthchecks from systemd timers; without systemd nothing runs them, so this
  script runs `podman healthcheck run` itself (depends_on's service_healthy is skipped by
  podman-compose on podman 4.3: the gateway starts at once and answers 503 until the engine is up).
- podman cannot map a host port range onto one container port ("host and container port ranges
  have different lengths"), so each gateway port is one free host port (TESSERA_*_PORTS).
- podman-compose 1.6's `down` leaves the containers `--scale` added; the script removes them.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from benchmarks.report import cpu_info, cpu_line, markdown_table, write_results
from benchmarks.soak import free_port
from scripts.compose_image import IMAGE, LOCAL_BASE, REPO, build_image, image_exists, image_mb, run

PROJECT = "tessera-check"  # compose project name: never the user's own `tessera` stack
NO_ENGINE = 3  # exit code: no container engine or compose tool here
LIMIT_S = {"engine": 60.0, "gateway": 60.0, "worker": 60.0}  # recovery limits per kill
PROMPT = "What is the capital of France?"
# Run inside a container on the stack's network: the health probe is open, EngineCore is not.
TOKEN_PROBE = """
import sys, grpc
from services.healthcheck import main as health
from services.pb import engine_pb2, engine_pb2_grpc
print("probe health", health(["grpc", sys.argv[1]]))
stub = engine_pb2_grpc.EngineCoreStub(grpc.insecure_channel(sys.argv[1]))
try:
    stub.GetServerInfo(engine_pb2.GetServerInfoRequest(), timeout=10)
    print("probe call OK")
except grpc.RpcError as e:
    print("probe call", e.code().name)
"""
# Run inside an engine container: its scheduler's request count, asked with the internal token.
FINISHED_PROBE = """
import os, grpc
from services.pb import engine_pb2, engine_pb2_grpc
stub = engine_pb2_grpc.EngineCoreStub(grpc.insecure_channel("127.0.0.1:50051"))
token = [("authorization", "Bearer " + os.environ["TESSERA_INTERNAL_TOKEN"])]
print(stub.GetStats(engine_pb2.GetStatsRequest(), metadata=token, timeout=10).num_finished)
"""


def missing_tools(podman: str | None, compose: list[str] | None) -> str | None:
    """Why the check cannot run here, or None when podman and a compose tool both work."""
    if podman is None:
        return "no container engine: `podman` is not on PATH (apt-get install podman runc)"
    if subprocess.run([podman, "info"], capture_output=True, check=False).returncode != 0:
        return "podman is installed but `podman info` fails (docs/deployment.md: podman settings)"
    if not compose or shutil.which(compose[0]) is None:
        return "no compose tool: install podman-compose (in its own venv) or pass --compose"
    return None


# ---- the running stack ---------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """One compose project of compose.yaml, driven through `compose` (podman-compose)."""

    podman: str
    compose: list[str]
    http_port: int
    grpc_port: int
    token: str

    def compose_run(self, *args: str, check: bool = True) -> str:
        env = {**os.environ, "COMPOSE_PROFILES": "cpu", "TESSERA_INTERNAL_TOKEN": self.token,
               "TESSERA_HTTP_PORTS": str(self.http_port),
               "TESSERA_GRPC_PORTS": str(self.grpc_port)}  # fmt: skip
        return run(*self.compose, "-p", PROJECT, *args, check=check, env=env)

    def containers(self) -> dict[str, str]:
        """container name -> its service, for this project's containers."""
        listing = run(self.podman, "ps", "-a", "--format", "json", "--filter",
                      f"label=com.docker.compose.project={PROJECT}")  # fmt: skip
        found = {
            c["Names"][0]: c["Labels"]["com.docker.compose.service"] for c in json.loads(listing)
        }
        return dict(sorted(found.items()))

    def container(self, service: str) -> str:
        """The first container of `service` (`<project>_<service>_1`)."""
        return next(name for name, s in self.containers().items() if s == service)

    def inspect(self, name: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(run(self.podman, "inspect", name))
        return data[0]

    def remove(self) -> None:
        """`down`, then whatever it left (podman-compose 1.6 forgets scaled containers)."""
        self.compose_run("down", check=False)
        leftovers = list(self.containers())
        if leftovers:
            run(self.podman, "rm", "-f", *leftovers, check=False)
            self.compose_run("down", check=False)  # the network, once nothing uses it

    def healthy(self) -> bool:
        """Every container's own healthcheck passes (run from here: podman 4.3 runs them from
        systemd timers, and there may be no systemd)."""
        names = list(self.containers())
        probe = [self.podman, "healthcheck", "run"]
        codes = [
            subprocess.run([*probe, n], capture_output=True, check=False).returncode for n in names
        ]
        return bool(names) and not any(codes)


def ask(port: int, timeout_s: float = 10, prompt: str = PROMPT) -> str | None:
    """The answer to `prompt` through the gateway's OpenAI API, or None when it fails."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=timeout_s
    )
    try:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16,
            temperature=0,
        )  # fmt: skip
        return reply.choices[0].message.content or ""
    except (openai.OpenAIError, IndexError):
        return None


def wait_until(probe: Any, limit_s: float, every_s: float = 0.25) -> float | None:
    """Seconds until probe() is true, or None past limit_s."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if probe():
            return time.monotonic() - start
        time.sleep(every_s)
    return None


def answers(stack: Stack) -> bool:
    return "Paris" in (ask(stack.http_port) or "")


# ---- checks --------------------------------------------------------------------------------


def published_ports(stack: Stack) -> dict[str, list[str]]:
    """container -> the host ports it publishes."""
    result: dict[str, list[str]] = {}
    for name in stack.containers():
        ports = stack.inspect(name)["NetworkSettings"]["Ports"] or {}
        result[name] = sorted(b["HostPort"] for binds in ports.values() for b in binds or [])
    return result


def only_gateway_publishes(stack: Stack, ports: dict[str, list[str]]) -> bool:
    expected = {"gateway": sorted([str(stack.http_port), str(stack.grpc_port)]), "engine": []}
    return all(ports[name] == expected[s] for name, s in stack.containers().items())


def token_probe(stack: Stack) -> dict[str, str]:
    """From the gateway's container (on the stack's network), with no token: the engine's
    health probe and an EngineCore call."""
    gateway = stack.container("gateway")
    out = run(stack.podman, "exec", gateway, "python", "-c", TOKEN_PROBE, "engine:50051")
    lines = [line.split(" ")[1:] for line in out.splitlines() if line.startswith("probe ")]
    return {k: v for k, v in lines}


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        if ppid == pid:
            found.append((int(stat.parent.name), cmdline))
    return found


def victim(stack: Stack, what: str) -> int:
    """The host pid to SIGKILL: a container's main process, or the engine's worker."""
    service = "gateway" if what == "gateway" else "engine"
    pid = int(stack.inspect(stack.container(service))["State"]["Pid"])
    if what == "worker":
        pid = next(p for p, cmd in children(pid) if "-m worker_service" in cmd)
    return pid


def kill_and_time(stack: Stack, what: str) -> dict[str, Any]:
    """SIGKILL `what` and time until the stack answers again; the container must restart for
    engine and gateway, and must not for the worker (the engine's supervisor restarts it)."""
    service = "gateway" if what == "gateway" else "engine"
    name = stack.container(service)
    restarts = int(stack.inspect(name)["RestartCount"])
    os.kill(victim(stack, what), signal.SIGKILL)
    recovered = wait_until(lambda: answers(stack), LIMIT_S[what])
    restarted = int(stack.inspect(name)["RestartCount"]) - restarts
    ok = recovered is not None and restarted == (0 if what == "worker" else 1)
    settled = wait_until(stack.healthy, 120, every_s=1)  # healthy again before the next kill
    return {"killed": what, "recovered_s": None if recovered is None else round(recovered, 1),
            "limit_s": LIMIT_S[what], "container_restarts": restarted,
            "healthy_again": settled is not None, "ok": ok and settled is not None}  # fmt: skip


def scale_engines(stack: Stack, engines: int, prompts: int = 12) -> dict[str, Any]:
    """`up --scale engine=N` on the running stack, then distinct prompts through the gateway:
    every engine replica must finish some (the gateway finds them by DNS)."""
    start = time.monotonic()
    stack.compose_run("up", "-d", "--scale", f"engine={engines}")
    names = [n for n, s in stack.containers().items() if s == "engine"]
    healthy = wait_until(stack.healthy, 300, every_s=1) is not None and len(names) == engines
    time.sleep(6)  # the gateway re-resolves `engine` every 5 s
    before = finished(stack, names)
    story = "Tell me a long story about the sea, the ships and their sailors. " * 4
    replies = [ask(stack.http_port, 30, f"{i}: {story}") for i in range(prompts)]
    served = [after - before[n] for n, after in finished(stack, names).items()]
    ok = healthy and all(r for r in replies) and all(n > 0 for n in served)
    # A gateway that starts while `engine` answers with several addresses (it used to crash).
    gateway = kill_and_time(stack, "gateway")
    return {"engines": len(names), "healthy_s": round(time.monotonic() - start, 1),
            "prompts": prompts, "finished_per_engine": served,
            "gateway_kill": gateway, "ok": ok and gateway["ok"]}  # fmt: skip


def finished(stack: Stack, names: list[str]) -> dict[str, int]:
    """engine container -> requests its scheduler finished (asked inside, with the token)."""
    return {n: int(run(stack.podman, "exec", n, "python", "-c", FINISHED_PROBE)) for n in names}


def check_stack(stack: Stack, rounds: int, engines: int) -> dict[str, Any]:
    """Bring the stack up and run every check; the stack is left up for the caller to remove."""
    start = time.monotonic()
    stack.compose_run("up", "-d")
    first = wait_until(lambda: answers(stack), 600, every_s=1)
    up_s = time.monotonic() - start
    healthy = wait_until(stack.healthy, 180, every_s=1) is not None
    answer = ask(stack.http_port) or ""
    ports = published_ports(stack)
    probe = token_probe(stack)
    checks = {
        "serves_paris": first is not None and "Paris" in answer,
        "healthchecks_pass": healthy,
        "only_gateway_publishes": only_gateway_publishes(stack, ports),
        "engine_health_open": probe.get("health") == "0",
        "engine_refuses_without_token": probe.get("call") == "UNAUTHENTICATED",
    }
    kills = [
        {"round": r + 1, **kill_and_time(stack, what)}
        for r in range(rounds)
        for what in ("engine", "gateway", "worker")
    ]
    for what in ("engine", "gateway", "worker"):
        checks[f"recovers_after_{what}_kill"] = all(k["ok"] for k in kills if k["killed"] == what)
    scaled = scale_engines(stack, engines) if engines > 1 else {}
    if scaled:
        checks[f"{engines}_engines_all_serve"] = scaled["ok"]
    return {"up_to_first_answer_s": round(up_s, 1), "answer": answer, "published_ports": ports,
            "token_probe": probe, "kills": kills, "scaled": scaled, "checks": checks}  # fmt: skip


def table(data: dict[str, Any]) -> str:
    checks = "\n".join(
        f"- {name}: {'pass' if ok else 'FAIL'}" for name, ok in data["checks"].items()
    )
    head = (f"{cpu_line(data['machine'])}\n\n"
            f"Compose check ({data['engine']}, {data['compose_tool']}, base image "
            f"{data['base_image']}): image build {data['build_s']} s ({data['image_mb']} MiB), `up` to first answer "
            f"{data['up_to_first_answer_s']} s; ok: {data['ok']}\n\n{checks}\n\n")  # fmt: skip
    columns = [
        "round",
        "killed",
        "recovered_s",
        "limit_s",
        "container_restarts",
        "healthy_again",
        "ok",
    ]
    scaled = data["scaled"]
    tail = (f"\n`--scale engine={scaled['engines']}`: {scaled['prompts']} distinct prompts, "
            f"finished per engine {scaled['finished_per_engine']}; the gateway killed then "
            f"answered again in {scaled['gateway_kill']['recovered_s']} s; ok: {scaled['ok']}\n"
            if scaled else "")  # fmt: skip
    return head + markdown_table(data["kills"], columns) + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.compose_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--compose", default="podman-compose", help="the compose command")
    p.add_argument("--base-image", default=None,
                   help=f"BASE_IMAGE build arg (default: {LOCAL_BASE} when present)")  # fmt: skip
    p.add_argument("--no-build", action="store_true", help=f"use the existing {IMAGE}")
    p.add_argument("--rounds", type=int, default=3, help="kills of each kind")
    p.add_argument("--engines", type=int, default=2, help="engine replicas of the scale check")
    p.add_argument("--fresh", action="store_true", help="start with an empty model-cache volume")
    p.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = p.parse_args(argv)
    podman, compose = shutil.which("podman"), args.compose.split()
    reason = missing_tools(podman, compose)
    if reason is not None or podman is None:
        print(f"compose check NOT RUN: {reason}", file=sys.stderr)
        return NO_ENGINE
    base = args.base_image
    if base is None and image_exists(podman, LOCAL_BASE):
        base = LOCAL_BASE
    build_s = 0.0 if args.no_build else build_image(podman, base)
    stack = Stack(podman, compose, free_port(), free_port(), secrets.token_hex(32))
    stack.remove()  # a leftover run of this check
    if args.fresh:
        stack.compose_run("down", "-v", check=False)
    try:
        result = check_stack(stack, args.rounds, args.engines)
    finally:
        stack.remove()
    data = {"machine": cpu_info(), "engine": run(podman, "--version").strip(),
            "compose_tool": run(*compose, "--version").splitlines()[0].strip(),
            "base_image": base or "Dockerfile default", "build_s": round(build_s, 1), "fresh_cache": args.fresh,
            "image_mb": image_mb(podman), **result}  # fmt: skip
    data["ok"] = all(data["checks"].values())
    print(table(data))
    write_results("compose_check", data, table(data), args.out)
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
