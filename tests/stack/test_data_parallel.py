"""`tessera serve --data-parallel-size 2` end to end (issue 13, acceptances 2-4): affinity
routing beats round robin on shared prefixes and spreads distinct prompts; a replica whose
scheduler is SIGKILLed fails its in-flight streams fast, the other takes new requests, and
the restarted replica gets traffic again; the official client works against the DP stack."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from benchmarks.dp_bench import (
    MODEL,
    SERVE_ARGS,
    DPServer,
    distinct_workload,
    measure,
    run_chats,
    shared_prefix_workload,
    start_dp_server,
)
from benchmarks.stack import REPO, beyond_loopback, tree_sockets
from services.healthcheck import http_healthy
from services.security import TOKEN_ENV
from tessera.launcher import terminate
from tests.conftest import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DPServer]:
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    server = start_dp_server(2, "affinity", SERVE_ARGS, log=log)
    yield server
    server.stop()


def test_every_replica_port_is_loopback_only(dp: DPServer) -> None:
    """Issue 25 (what held): gateway, both schedulers and both workers listen on and talk to
    loopback only."""
    sockets = tree_sockets(dp.process.pid)
    listening = [s for s in sockets if s[2] == "LISTEN"]
    assert len(listening) >= 5, sockets  # a gateway, 2 schedulers, 2 workers at least
    assert beyond_loopback(sockets) == []


def test_affinity_beats_round_robin_and_distinct_prompts_spread(
    dp: DPServer, tmp_path: Path
) -> None:
    # The bench's shared-prefix workload (8 system prompts x 16 questions; each KV pool holds
    # about three of the system prompts, so the working set fits two pools but not one), the
    # same requests against fresh replicas under each routing, and half its distinct prompts.
    # Fewer questions per system prompt made the measured ratio noisy (1.7 with 5, 1.9 with 10).
    shared = shared_prefix_workload(8, 16, 260, seed=0)
    affinity = measure(dp, shared, concurrency=4)
    rr_stack = start_dp_server(2, "round-robin", SERVE_ARGS, log=tmp_path / "rr.log")
    try:
        rr = measure(rr_stack, shared, concurrency=4)
    finally:
        rr_stack.stop()
    assert affinity["failed"] == rr["failed"] == 0
    assert rr["per_replica"] == [64, 64]  # round robin: strictly alternating
    assert affinity["hit_rate"] >= 1.8 * rr["hit_rate"], (affinity, rr)
    distinct = measure(dp, distinct_workload(32, 65, seed=13), concurrency=4)
    assert distinct["failed"] == 0 and distinct["max_share"] <= 0.6, distinct


def test_official_client_against_two_replicas(dp: DPServer) -> None:
    client = openai.OpenAI(base_url=f"{dp.base_url}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "Name a colour."}]
    before = [s.num_finished for s in dp.all_stats()]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=2,
                                          temperature=0.0)  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.message.content for c in chat.choices)
    # Both samples share the prompt, so affinity sends them to one replica. (Their bf16 texts
    # may still differ: the second can hit the first's cached prompt; --deterministic aside.)
    finished = [s.num_finished - b for s, b in zip(dp.all_stats(), before, strict=True)]
    assert sorted(finished) == [0, 2], finished
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages, max_tokens=2)
    assert sum(s.num_finished for s in dp.all_stats()) > 0


def _stream(url: str, prompt: str, out: dict[str, Any]) -> None:
    """Stream a long completion; record each event's arrival time."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "stream": True}  # fmt: skip
    events: list[tuple[float, str]] = []
    out["events"] = events
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
            out["status"] = reply.status_code
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line))
    except httpx.HTTPError as exc:
        out["exception"] = (time.monotonic(), repr(exc))


def test_sigkill_one_scheduler(tmp_path: Path) -> None:
    server = start_dp_server(2, "affinity", SERVE_ARGS, log=tmp_path / "serve.log")
    try:
        results = [dict[str, Any]() for _ in range(6)]
        threads = [threading.Thread(target=_stream, args=(server.base_url,
                   f"Story {i}: " + "the quiet harbor at dawn " * 8, results[i]))
                   for i in range(6)]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not all(r.get("events") for r in results):  # every stream is producing
            assert time.monotonic() < deadline, results
            time.sleep(0.1)
        running = [s.num_running for s in server.all_stats()]
        assert running[0] > 0 and sum(running) == 6, running
        pid = server.scheduler_pid(0)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(180)
        failed = [r for r in results if any('"error"' in e for _, e in r["events"])]
        assert len(failed) == running[0], results
        for r in failed:  # the error event came within 2 s, and the stream then ended
            error_at = next(at for at, e in r["events"] if '"error"' in e)
            assert error_at - killed_at < 2.0, error_at - killed_at
            assert r["events"][-1][1] == "data: [DONE]"
        for r in results:
            if r not in failed:
                assert r["status"] == 200 and r["events"][-1][1] == "data: [DONE]"
        # new requests all succeed (replica 0 is down or restarting)
        chats = distinct_workload(8, 30, seed=21)
        totals = asyncio.run(run_chats(server.base_url, chats, concurrency=4))
        assert totals["failed"] == 0, totals
        # the launcher restarts scheduler 0, which then gets traffic again
        deadline = time.monotonic() + 120
        while True:
            try:
                before = server.stats(0).num_finished
                break
            except Exception:
                assert time.monotonic() < deadline, "scheduler 0 did not come back"
                time.sleep(0.5)
        # the gateway routes to it again once its channel reconnected and a poll saw it healthy
        deadline, seed = time.monotonic() + 90, 22
        while server.stats(0).num_finished == before:
            assert time.monotonic() < deadline, "the restarted replica got no traffic"
            totals = asyncio.run(run_chats(server.base_url, distinct_workload(4, 30, seed), 4))
            assert totals["failed"] == 0, totals
            seed += 1
    finally:
        server.stop()


def _spawn(argv: list[str], log: Path, token: str) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT, env={**os.environ, TOKEN_ENV: token})  # fmt: skip


def test_engine_container_entry_behind_a_gateway_given_a_dns_name(tmp_path: Path) -> None:
    """What a compose engine container and a gateway run: `tessera engine`, and a gateway
    whose --scheduler is a host name (re-resolved; one address keeps the name)."""
    scheduler_port, worker_port, port = free_port(), free_port(), free_port()
    engine = _spawn(["-m", "tessera", "engine", "--host", "127.0.0.1", "--scheduler-port",
                     str(scheduler_port), "--worker-port", str(worker_port),
                     "--kv-cache-memory", "256MiB", "--max-model-len", "512"],
                    tmp_path / "engine.log", "t0ken")  # fmt: skip
    gateway = _spawn(["-m", "gateway", "--scheduler", f"localhost:{scheduler_port}", "--port",
                      str(port), "--grpc-port", "0"], tmp_path / "gateway.log", "t0ken")  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while not http_healthy(f"{url}/health", 2):
            assert engine.poll() is None and gateway.poll() is None
            assert time.monotonic() < deadline, (tmp_path / "engine.log").read_text()[-2000:]
            time.sleep(0.5)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        for process in (gateway, engine):
            terminate(process, 30)
