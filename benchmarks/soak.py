"""`make soak`: a long mixed workload against a `tessera serve` it starts itself.

Requests mix HTTP streaming, HTTP non-streaming and the gRPC text API; a share of
clients disconnect at a random point; some ask n=2, some carry stop strings. At the
end: counts by outcome, 0 5xx, every completed request of the right length, each
service's RSS after warm-up and at the end (within 10%), 0 KV blocks in use
(EngineCore GetStats, with the internal token). Exit code 1 when a check fails.

    python -m benchmarks.soak --requests 2000 --out bench-results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from benchmarks.report import cpu_info, cpu_line, markdown_table, write_results
from services.config import SecurityConfig
from services.grpc_utils import aio_channel, sync_channel
from services.healthcheck import http_healthy
from services.pb import engine_pb2, engine_pb2_grpc
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from services.security import TOKEN_ENV

SERVICES = ("worker_service", "scheduler_service", "gateway")
STOPS = [" the", ".", "\n"]


@dataclass
class Server:
    """A `tessera serve` process tree and how to reach it."""

    process: subprocess.Popen[bytes]
    port: int
    grpc_port: int
    scheduler_port: int
    token: str

    def pids(self) -> dict[str, int]:
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(self.process.pid)],
                             capture_output=True, text=True, check=False).stdout  # fmt: skip
        found = {}
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            found.update({name: int(pid) for name in SERVICES if f"-m {name}" in args})
        return found

    def rss_mb(self) -> dict[str, float]:
        return {name: _rss(pid) / 1e6 for name, pid in self.pids().items()}

    def stats(self) -> Any:
        address = f"127.0.0.1:{self.scheduler_port}"
        with sync_channel(address, security=SecurityConfig(token=self.token)) as channel:
            return engine_pb2_grpc.EngineCoreStub(channel).GetStats(engine_pb2.GetStatsRequest())


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(serve_args: Sequence[str], timeout_s: float = 300) -> Server:
    port, grpc_port, scheduler_port, worker_port = (free_port() for _ in range(4))
    token = secrets.token_urlsafe(16)
    argv = [sys.executable, "-m", "tessera", "serve", "--port", str(port),
            "--grpc-port", str(grpc_port), "--scheduler-port", str(scheduler_port),
            "--worker-port", str(worker_port), *serve_args]  # fmt: skip
    process = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env={**os.environ, TOKEN_ENV: token},
    )
    deadline = time.monotonic() + timeout_s
    while not http_healthy(f"http://127.0.0.1:{port}/health", 2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("tessera serve did not start")
        time.sleep(0.5)
    return Server(process, port, grpc_port, scheduler_port, token)


# ---- one client ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What one client does."""

    kind: str  # "http-stream", "http", "grpc-stream" or "grpc"
    max_tokens: int
    n: int
    stop: list[str]
    disconnect_after_s: float | None  # None: reads to the end


def make_plan(rng: random.Random) -> Plan:
    kind = rng.choices(["http-stream", "http", "grpc-stream", "grpc"], [35, 30, 20, 15])[0]
    n = 2 if kind.startswith("http") and rng.random() < 0.2 else 1
    stop = [rng.choice(STOPS)] if rng.random() < 0.2 else []
    disconnect = rng.uniform(0.0, 1.5) if rng.random() < 0.3 else None
    return Plan(kind, rng.randint(4, 24), n, stop, disconnect)


def _prompt(i: int) -> str:
    return f"Request {i}: write one sentence about the number {i % 97}."


async def http_client(client: httpx.AsyncClient, i: int, plan: Plan) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": _prompt(i)}], "max_tokens": plan.max_tokens,
            "n": plan.n, "stop": plan.stop or None, "temperature": 0.8, "seed": i,
            "stream": plan.kind == "http-stream"}  # fmt: skip
    if plan.kind == "http-stream":
        body["stream_options"] = {"include_usage": True}
        async with client.stream("POST", "/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                return {"status": reply.status_code}
            usage, finishes = None, {}
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason"):
                        finishes[choice["index"]] = choice["finish_reason"]
            return {"status": 200, "usage": usage, "finishes": list(finishes.values())}
    reply = await client.post("/chat/completions", json=body)
    if reply.status_code != 200:
        return {"status": reply.status_code}
    data = reply.json()
    return {"status": 200, "usage": data["usage"],
            "finishes": [c["finish_reason"] for c in data["choices"]]}  # fmt: skip


async def grpc_client(stub: Any, metadata: Any, i: int, plan: Plan) -> dict[str, Any]:
    params = pb.TextSamplingParams(max_tokens=plan.max_tokens, stop=plan.stop, temperature=0.8,
                                   seed=i)  # fmt: skip
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=_prompt(i))],
                             params=params)  # fmt: skip
    try:
        if plan.kind == "grpc-stream":
            usage, finish = None, ""
            async for chunk in stub.ChatStream(request, metadata=metadata):
                finish = chunk.finish_reason or finish
                usage = chunk.usage if chunk.HasField("usage") else usage
        else:
            reply = await stub.Chat(request, metadata=metadata)
            usage, finish = reply.usage, reply.finish_reason
    except grpc.aio.AioRpcError as exc:
        return {"status": exc.code().name}
    tokens = usage.completion_tokens if usage is not None else -1
    return {"status": 200, "usage": {"completion_tokens": tokens}, "finishes": [finish]}


def check_length(plan: Plan, result: dict[str, Any]) -> bool:
    """A completed request produced max_tokens per choice unless a choice stopped early."""
    usage, finishes = result.get("usage"), result.get("finishes", [])
    if usage is None or len(finishes) != plan.n:
        return False
    tokens = usage["completion_tokens"]
    if all(f == "length" for f in finishes):
        return bool(tokens == plan.n * plan.max_tokens)
    return 0 < tokens <= plan.n * plan.max_tokens or (tokens == 0 and "stop" in finishes)


async def one(ctx: dict[str, Any], i: int, plan: Plan) -> str:
    if plan.kind.startswith("http"):
        work = http_client(ctx["http"], i, plan)
    else:
        work = grpc_client(ctx["stub"], ctx["metadata"], i, plan)
    task = asyncio.ensure_future(work)
    if plan.disconnect_after_s is not None:
        done, _ = await asyncio.wait({task}, timeout=plan.disconnect_after_s)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return "disconnected"
    try:
        result = await task
    except httpx.HTTPError as exc:
        return f"transport-error:{type(exc).__name__}"
    status = result["status"]
    if status != 200:
        return f"status-{status}"
    return "completed" if check_length(plan, result) else "wrong-length"


async def drive(server: Server, num: int, concurrency: int, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    plans = [make_plan(rng) for _ in range(num)]
    limit = asyncio.Semaphore(concurrency)
    outcomes: Counter[str] = Counter()
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}/v1", timeout=120) as http,
        aio_channel(f"127.0.0.1:{server.grpc_port}", security=SecurityConfig()) as channel,
    ):
        ctx = {"http": http, "stub": pb_grpc.TextGenerationStub(channel), "metadata": None}

        async def run(i: int) -> None:
            async with limit:
                outcomes[await one(ctx, i, plans[i])] += 1

        await asyncio.gather(*(run(i) for i in range(num)))
    return outcomes


def wait_idle(server: Server, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    stats = server.stats()
    while (stats.num_running or stats.num_waiting or stats.num_blocks_used) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
        stats = server.stats()
    return stats


def soak(
    num: int, concurrency: int, warmup: int, seed: int, serve_args: Sequence[str]
) -> dict[str, Any]:
    """Run the soak; returns the results (`ok` says whether every check passed)."""
    server = start_server(serve_args)
    try:
        start = time.monotonic()
        warm = asyncio.run(drive(server, warmup, concurrency, seed + 1))
        wait_idle(server)
        rss_warm = server.rss_mb()
        timeline: list[dict[str, float]] = []
        done = threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(server, timeline, done), daemon=True)
        sampler.start()
        outcomes = asyncio.run(drive(server, num, concurrency, seed))
        elapsed = time.monotonic() - start
        done.set()
        sampler.join()
        stats = wait_idle(server)
        rss_end = server.rss_mb()
    finally:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
    growth = {k: rss_end[k] / rss_warm[k] - 1 for k in rss_warm}
    checks = {
        "no_5xx": not any(k.startswith("status-5") for k in outcomes),
        "all_completed_right_length": outcomes["wrong-length"] == 0,
        "no_errors": all(k in ("completed", "disconnected") for k in outcomes),
        "rss_within_10pct": all(abs(g) <= 0.10 for g in growth.values()),
        "no_blocks_in_use": stats.num_blocks_used == 0,
    }
    return {
        "requests": num, "concurrency": concurrency, "warmup_requests": warmup, "seed": seed,
        "elapsed_s": round(elapsed, 1), "outcomes": dict(outcomes), "warmup_outcomes": dict(warm),
        "rss_mb_after_warmup": _round(rss_warm), "rss_mb_end": _round(rss_end),
        "rss_growth": _round(growth, 4), "kv_blocks_in_use_end": stats.num_blocks_used,
        "rss_mb_timeline": timeline,
        "checks": checks, "ok": all(checks.values()),
        "machine": cpu_info(),
    }  # fmt: skip


def _sample_rss(
    server: Server, timeline: list[dict[str, float]], done: threading.Event, every_s: float = 15.0
) -> None:
    """Append {t, service: RSS MB} every `every_s` seconds until `done` is set."""
    start = time.monotonic()
    while True:
        timeline.append({"t": round(time.monotonic() - start, 1), **_round(server.rss_mb())})
        if done.wait(every_s):
            return


def _round(d: dict[str, float], digits: int = 1) -> dict[str, float]:
    return {k: round(v, digits) for k, v in d.items()}


def table(data: dict[str, Any]) -> str:
    rows = [{"service": s, "rss_mb_after_warmup": data["rss_mb_after_warmup"][s],
             "rss_mb_end": data["rss_mb_end"][s], "growth": data["rss_growth"][s]}
            for s in data["rss_mb_after_warmup"]]  # fmt: skip
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(data["outcomes"].items()))
    head = (f"{cpu_line(data['machine'])}\n\n"
            f"Soak: {data['requests']} requests in {data['elapsed_s']} s ({outcomes}); "
            f"KV blocks in use at the end: {data['kv_blocks_in_use_end']}; ok: {data['ok']}\n\n")  # fmt: skip
    return head + markdown_table(rows, ["service", "rss_mb_after_warmup", "rss_mb_end", "growth"])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--warmup", type=int, default=200, help="requests before the RSS baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write soak.json/.md here")
    p.add_argument("serve_args", nargs="*", help="extra `tessera serve` flags (after --)")
    args = p.parse_args(argv)
    data = soak(args.requests, args.concurrency, args.warmup, args.seed, args.serve_args)
    print(table(data))
    if args.out is not None:
        write_results("soak", data, table(data), args.out)
    sys.exit(0 if data["ok"] else 1)


if __name__ == "__main__":
    main()
