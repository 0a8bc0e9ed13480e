"""Issue 14, acceptance 1: the fault matrix through real processes.

`tessera serve` supervises worker, scheduler and gateway; 32 concurrent streams run through
the official openai client while one service at a time is SIGKILLed (worker, then
scheduler, then gateway). Every in-flight stream ends with its complete output or an error
within 2 s of the kill; the stack answers a new request within 30 s of each kill; at the end
no KV block is in use, SIGTERM of the launcher leaves no process behind and /dev/shm holds
no new entries.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from benchmarks.stack import Stack, start_stack
from services.grpc_utils import sync_channel
from services.pb import engine_pb2, engine_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 32
MAX_TOKENS = 48
END_WITHIN_S = 2.0
BACK_WITHIN_S = 30.0


@dataclass
class Outcome:
    """How one stream ended."""

    tokens: int = 0  # completion tokens reported by the final usage chunk
    finish_reason: str | None = None
    error: str = ""
    started: bool = False  # the first chunk arrived
    ended_at: float = 0.0


def _stream(client: openai.OpenAI, i: int, out: Outcome) -> None:
    try:
        chunks = client.completions.create(
            model=MODEL,
            prompt=f"Story {i}: once upon a time",
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in chunks:
            out.started = True
            if chunk.choices and chunk.choices[0].finish_reason:
                out.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
    except (openai.APIError, OSError) as exc:  # an SSE error event, a 5xx or a broken connection
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended_at = time.monotonic()


def _answers(client: openai.OpenAI) -> bool:
    try:
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    except (openai.APIError, OSError):
        return False
    return reply.choices[0].text is not None


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _log_tail(stack: Stack) -> str:
    """The services' log without the access lines."""
    return "".join(line for line in stack.lines if "gateway.access" not in line)[-6000:]


def _blocks_in_use(stack: Stack) -> int:
    with sync_channel(stack.scheduler_address, security=stack.internal) as channel:
        stats = engine_pb2_grpc.EngineCoreStub(channel).GetStats(
            engine_pb2.GetStatsRequest(), timeout=10
        )
    return int(stats.num_blocks_used)


def _kill_during_streams(stack: Stack, client: openai.OpenAI, victim: str) -> list[str]:
    """Run the streams, SIGKILL `victim` once all of them stream; returns the problems."""
    outcomes = [Outcome() for _ in range(NUM_STREAMS)]
    threads = [
        threading.Thread(target=_stream, args=(client, i, o)) for i, o in enumerate(outcomes)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(o.started or o.ended_at for o in outcomes):
        assert time.monotonic() < deadline, f"the streams did not start before killing {victim}"
        time.sleep(0.05)
    os.kill(stack.service_pids()[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(60)
    problems = []
    for i, o in enumerate(outcomes):
        if o.error:
            if o.ended_at - killed_at > END_WITHIN_S:
                problems.append(f"{victim}: stream {i} errored {o.ended_at - killed_at:.1f}s late")
        elif o.finish_reason != "length" or o.tokens != MAX_TOKENS:
            problems.append(f"{victim}: stream {i} incomplete: {o}")
    while not _answers(client):
        if time.monotonic() - killed_at > BACK_WITHIN_S:
            problems.append(f"{victim}: no answer within {BACK_WITHIN_S:.0f}s of the kill")
            break
        time.sleep(0.25)
    errored = sum(1 for o in outcomes if o.error)
    print(
        f"{victim}: {errored} streams errored, answering {time.monotonic() - killed_at:.1f}s after the kill"
    )
    return problems


def test_sigkill_each_service_under_32_streams() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    stack = start_stack("--dtype", "float32", "--kv-cache-memory", "256MiB")
    seen: set[int] = set()
    try:
        client = openai.OpenAI(
            base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        assert _answers(client), stack.output()[-3000:]
        problems: list[str] = []
        for victim in ("worker_service", "scheduler_service", "gateway"):
            seen |= _descendants(stack.process.pid)
            problems += _kill_during_streams(stack, client, victim)
            assert stack.wait_for_line(f"{victim.split('_')[0]} died (exit code -9)", 5)
        assert not problems, "\n".join([*problems, _log_tail(stack)])
        deadline = time.monotonic() + 10
        while _blocks_in_use(stack) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _blocks_in_use(stack) == 0
        seen |= _descendants(stack.process.pid)
    finally:
        code = stack.stop()
    assert code == 0, stack.output()[-3000:]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in seen if _alive(p)], "processes outlived tessera serve"
    assert not set(os.listdir("/dev/shm")) - shm_before
