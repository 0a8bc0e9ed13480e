"""`make bench-dp`: data-parallel engine replicas, prefix-affinity routing vs round robin.

Starts `tessera serve --data-parallel-size 2` (default model) once per routing
and runs two workloads against it:

- shared prefix: 8 system prompts of 300+ tokens x 16 questions each, shuffled,
  max_tokens 2. The KV budget is sized so one replica's pool holds about three of
  the system prompts: the working set fits the two pools together but not one,
  which is where routing by prefix matters. Prefix-cache hit rate = cached prompt
  tokens / prompt tokens (usage.prompt_tokens_details, and the schedulers' own
  prefix_cache_hits / prefix_cache_queries).
- distinct: 64 requests with distinct prompts; requests per replica from each
  scheduler's num_finished (no replica should take over 60%).

    python -m benchmarks.dp_bench --out bench-results
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.report import RESULTS_DIR, cpu_info, cpu_line, markdown_table, write_results
from benchmarks.soak import free_port
from services.config import SecurityConfig
from services.grpc_utils import sync_channel
from services.healthcheck import http_healthy
from services.pb import engine_pb2, engine_pb2_grpc
from services.security import TOKEN_ENV
from tessera.data_parallel import PORT_STRIDE
from tessera.launcher import terminate

MODEL = "SmolLM2-135M-Instruct"
# About three 300-token system prompts per replica pool (bf16 SmolLM2-135M: 22.5 KiB/token).
SERVE_ARGS = ("--kv-cache-memory", "48MiB", "--max-model-len", "512", "--max-num-seqs", "16")
WORDS = tuple(
    [
        "river",
        "stone",
        "lantern",
        "orbit",
        "meadow",
        "copper",
        "signal",
        "harbor",
        "violet",
        "engine",
        "canyon",
        "ledger",
        "falcon",
        "quartz",
        "tundra",
        "beacon",
        "willow",
        "saddle",
        "cobalt",
        "prism",
        "summit",
        "glacier",
        "thistle",
        "anchor",
        "ember",
        "fjord",
        "marble",
        "nectar",
        "oasis",
        "pepper",
        "quill",
        "rustle",
        "saffron",
        "timber",
        "umber",
        "velvet",
        "walnut",
        "yarrow",
        "zephyr",
        "amber",
        "basalt",
        "cinder",
        "dune",
        "fern",
        "grove",
        "heron",
        "iris",
        "jasper",
        "kelp",
    ]
)


@dataclass
class DPServer:
    """A `tessera serve --data-parallel-size N` process tree and how to reach it."""

    process: subprocess.Popen[bytes]
    port: int
    scheduler_ports: list[int]
    token: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self, replica: int) -> Any:
        """GetStats of one replica's scheduler."""
        address = f"127.0.0.1:{self.scheduler_ports[replica]}"
        with sync_channel(address, security=SecurityConfig(token=self.token)) as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            return stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)

    def all_stats(self) -> list[Any]:
        return [self.stats(i) for i in range(len(self.scheduler_ports))]

    def scheduler_pid(self, replica: int) -> int | None:
        """pid of one replica's scheduler (a child of the launcher)."""
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(self.process.pid)],
                             capture_output=True, text=True, check=False).stdout  # fmt: skip
        port = f"--port {self.scheduler_ports[replica]}"
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            if "-m scheduler_service" in args and port in args:
                return int(pid)
        return None

    def stop(self, timeout_s: float = 60) -> None:
        terminate(self.process, timeout_s)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(size: int) -> int:
    """A port p with p + PORT_STRIDE * i free for i < size (the launcher's replica ports)."""
    while True:
        port = free_port()
        if port + PORT_STRIDE * size < 65536 and all(
            _free(port + PORT_STRIDE * i) for i in range(1, size)
        ):
            return port


def start_dp_server(
    size: int, routing: str, serve_args: Sequence[str] = SERVE_ARGS, timeout_s: float = 600,
    log: Path | None = None,
) -> DPServer:  # fmt: skip
    """Start `tessera serve --data-parallel-size size --routing routing`; wait for /health."""
    port, grpc_port = free_port_range(1), free_port_range(1)
    scheduler_port, worker_port = free_port_range(size), free_port_range(size)
    token = secrets.token_urlsafe(16)
    argv = [sys.executable, "-m", "tessera", "serve", "--port", str(port),
            "--grpc-port", str(grpc_port), "--scheduler-port", str(scheduler_port),
            "--worker-port", str(worker_port), "--data-parallel-size", str(size),
            "--routing", routing, *serve_args]  # fmt: skip
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    process = subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, TOKEN_ENV: token}
    )
    ports = [scheduler_port + PORT_STRIDE * i for i in range(size)]
    server = DPServer(process, port, ports, token)
    deadline = time.monotonic() + timeout_s
    while not http_healthy(f"{server.base_url}/health", 2):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop(5)
            raise RuntimeError("tessera serve --data-parallel-size did not start")
        time.sleep(0.5)
    return server


def system_prompt(rng: random.Random, words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are archivist #{rng.randrange(10**6)}. Keep these notes in mind: {body}."


def shared_prefix_workload(
    prompts: int, questions: int, words: int, seed: int
) -> list[list[dict[str, str]]]:
    """`prompts` system prompts x `questions` questions each, shuffled (chat messages)."""
    rng = random.Random(seed)
    systems = [system_prompt(rng, words) for _ in range(prompts)]
    chats = [
        [
            {"role": "system", "content": s},
            {
                "role": "user",
                "content": f"Question {q}: which word comes after '{rng.choice(WORDS)}'?",
            },
        ]
        for s in systems
        for q in range(questions)
    ]
    rng.shuffle(chats)
    return chats


def distinct_workload(count: int, words: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [[{"role": "user", "content": system_prompt(rng, words)}] for _ in range(count)]


async def run_chats(
    base_url: str, chats: list[list[dict[str, str]]], concurrency: int, max_tokens: int = 2
) -> dict[str, Any]:
    """Send every chat (bounded concurrency); sums of prompt and cached tokens, failures."""
    sem = asyncio.Semaphore(concurrency)
    totals = {"requests": 0, "failed": 0, "prompt_tokens": 0, "cached_tokens": 0}

    async def one(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> None:
        async with sem:
            body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                    "temperature": 0.0}  # fmt: skip
            reply = await client.post("/v1/chat/completions", json=body)
        totals["requests"] += 1
        if reply.status_code != 200:
            totals["failed"] += 1
            return
        usage = reply.json()["usage"]
        totals["prompt_tokens"] += usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        totals["cached_tokens"] += details.get("cached_tokens") or 0

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await asyncio.gather(*(one(client, chat) for chat in chats))
    return totals


def measure(
    server: DPServer, chats: list[list[dict[str, str]]], concurrency: int
) -> dict[str, Any]:
    """Run `chats`; hit rates from usage and from the schedulers, requests per replica."""
    before = server.all_stats()
    start = time.perf_counter()
    totals = asyncio.run(run_chats(server.base_url, chats, concurrency))
    elapsed = time.perf_counter() - start
    after = server.all_stats()
    per_replica = [a.num_finished - b.num_finished for a, b in zip(after, before, strict=True)]
    hits = sum(
        a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before, strict=True)
    )
    queries = sum(
        a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before, strict=True)
    )
    return {
        **totals,
        "seconds": elapsed,
        "hit_rate": totals["cached_tokens"] / max(1, totals["prompt_tokens"]),
        "scheduler_hit_rate": hits / max(1, queries),
        "per_replica": per_replica,
        "max_share": max(per_replica) / max(1, sum(per_replica)),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    shared = shared_prefix_workload(args.prompts, args.questions, args.words, args.seed)
    distinct = distinct_workload(args.distinct, args.words // 4, args.seed + 1)
    results: dict[str, Any] = {"cpu": cpu_info(), "serve_args": list(args.serve_args)}
    for routing in ("affinity", "round-robin"):
        server = start_dp_server(2, routing, args.serve_args)
        try:
            results[routing] = {
                "shared_prefix": measure(server, shared, args.concurrency),
                "distinct": measure(server, distinct, args.concurrency),
            }
        finally:
            server.stop()
        print(routing, results[routing], flush=True)
    aff, rr = results["affinity"]["shared_prefix"], results["round-robin"]["shared_prefix"]
    results["hit_rate_ratio"] = aff["hit_rate"] / max(1e-9, rr["hit_rate"])
    results["pass"] = {
        "affinity_hit_rate_ge_1.8x_round_robin": results["hit_rate_ratio"] >= 1.8,
        "distinct_max_share_le_0.6": results["affinity"]["distinct"]["max_share"] <= 0.6,
    }
    return results


def table(results: dict[str, Any]) -> str:
    rows = []
    for routing in ("affinity", "round-robin"):
        for workload in ("shared_prefix", "distinct"):
            r = results[routing][workload]
            rows.append({"routing": routing, "workload": workload, "requests": r["requests"],
                         "failed": r["failed"], "hit rate": r["hit_rate"],
                         "scheduler hit rate": r["scheduler_hit_rate"],
                         "per replica": "/".join(map(str, r["per_replica"])),
                         "max share": r["max_share"], "seconds": r["seconds"]})  # fmt: skip
    cols = ["routing", "workload", "requests", "failed", "hit rate", "scheduler hit rate",
            "per replica", "max share", "seconds"]  # fmt: skip
    head = (
        "# Data parallel: 2 engine replicas, prefix-affinity routing vs round robin\n\n"
        f"{cpu_line(results['cpu'])}\n\n`tessera serve --data-parallel-size 2 "
        f"{' '.join(results['serve_args'])}`; shared prefix: 8 system prompts x 16 questions.\n\n"
    )
    checks = "\n".join(f"- {k}: {'PASS' if v else 'FAIL'}" for k, v in results["pass"].items())
    ratio = f"\nhit rate affinity / round robin: {results['hit_rate_ratio']:.2f}x\n\n"
    return head + markdown_table(rows, cols) + ratio + checks + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dp_bench", description=__doc__)
    p.add_argument("--prompts", type=int, default=8, help="system prompts")
    p.add_argument("--questions", type=int, default=16, help="questions per system prompt")
    p.add_argument("--words", type=int, default=260, help="words per system prompt (300+ tokens)")
    p.add_argument("--distinct", type=int, default=64, help="distinct-prompt requests")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("serve_args", nargs="*", default=list(SERVE_ARGS), help="tessera serve flags")
    args = p.parse_args(argv)
    results = run(args)
    write_results("dp", results, table(results), args.out)
    print(table(results))
    if not all(results["pass"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
