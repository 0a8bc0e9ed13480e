"""Scheduler + gRPC overhead per engine step: everything except the forward.

    python -m benchmarks.step_overhead_bench [--running 32 256] [--steps 300] [--repeat 3]
                                             [--compare EARLIER.json]

Three processes, as in production: an instant fake worker (one token per
sampling request, no model) behind the real Worker gRPC service
(`worker_service.server.build_server`); this process, running the real
EngineCore gRPC service with the real GrpcWorkerClient; and a client process
holding N concurrent long generations through the gateway's EngineClient (one
multiplexed GenerateStream call), so N requests run every step. The engine
schedules asynchronously and talks to the worker over its ExecuteModelStream.
`--compare` shows an earlier run's step_overhead.json as the "before" columns.

Per engine-loop iteration it times, on the engine thread: schedule(),
SchedulerOutput -> proto, the time blocked waiting for the worker's reply
(less the worker's own time), proto -> ModelRunnerOutput, update_from_output()
and publish; in the worker process: the servicer's proto -> SchedulerOutput and
ModelRunnerOutput -> proto and the worker's own step time (the "forward", here
almost nothing). The total is the wall time from one schedule() to the next
minus the worker's own time; "loop glue" is what the total holds beyond the
timed parts (waiting for the GIL held by the gRPC and asyncio threads, the
engine loop's inbox). With async scheduling the iteration that schedules step
n+1 commits step n, so the worker runs while the engine thread schedules.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS_DIR, bar_plot, markdown_table, write_results
from benchmarks.step_overhead_procs import BLOCK_SIZE, PROMPT_LEN, client_process, worker_process
from scheduler_service import worker_stream
from scheduler_service.engine import EngineCore
from scheduler_service.service import EngineCoreServer
from scheduler_service.worker_client import GrpcWorkerClient
from scheduler_service.worker_stream import StreamStep
from services.config import CacheConfig, SchedulerConfig
from services.step_types import (
    ModelRunnerOutput,
    SchedulerOutput,
)

WARMUP_STEPS = 20
PARTS = [
    "schedule",
    "encode",
    "transport",
    "worker_convert",
    "decode",
    "update",
    "publish",
    "loop_glue",
]
PART_LABELS = {
    "schedule": "schedule()",
    "encode": "SchedulerOutput -> proto",
    "transport": "waiting for the worker's reply - worker time",
    "worker_convert": "worker: proto -> domain -> proto",
    "decode": "proto -> ModelRunnerOutput",
    "update": "update_from_output()",
    "publish": "publish (engine thread)",
    "loop_glue": "loop glue / GIL waits",
    "total": "TOTAL per-step overhead",
    "event_loop_cpu": "asyncio thread CPU (streams, overlaps)",
}


# ---- the scheduler side (this process) ----------------------------------------


class StepRecorder:
    """Per-step wall times of the engine thread's parts, keyed by step id."""

    def __init__(self, loop_thread_id: int) -> None:
        self.loop_clock = time.pthread_getcpuclockid(loop_thread_id)
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}

    def begin_step(self) -> None:
        now, cpu = time.perf_counter(), time.clock_gettime(self.loop_clock)
        if self.current:
            self.current["period"] = now - self.current["start"]
            self.current["event_loop_cpu"] = cpu - self.current["loop_cpu"]
            self.steps.append(self.current)
        self.current = {"start": now, "loop_cpu": cpu}

    def add(self, part: str, seconds: float) -> None:
        self.current[part] = self.current.get(part, 0.0) + seconds

    def note_output(self, output: ModelRunnerOutput, so: SchedulerOutput | None) -> None:
        """The step this iteration committed: its id, size and the worker's own time."""
        self.current["worker_ms"] = output.timings.total_ms
        self.current["step_id"] = output.step_id
        self.current["num_tokens"] = (
            so.total_num_scheduled_tokens if so is not None else len(output.req_ids)
        )

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.add(part, time.perf_counter() - start)

        return timed


class TimedWorkerClient(GrpcWorkerClient):
    """GrpcWorkerClient that reports each stream step's wait to a recorder."""

    recorder: StepRecorder | None = None

    def submit_model(self, scheduler_output: SchedulerOutput) -> Any:
        handle = super().submit_model(scheduler_output)
        return handle if self.recorder is None else _TimedStep(handle, self.recorder)


class _TimedStep:
    """A step on the stream whose result() time goes to the recorder as "rpc"."""

    def __init__(self, handle: StreamStep, recorder: StepRecorder) -> None:
        self.handle, self.recorder = handle, recorder

    def result(self) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self.handle.result()
        self.recorder.add("rpc", time.perf_counter() - start)
        self.recorder.note_output(output, None)
        return output


def _timed_conversions(recorder: StepRecorder) -> Callable[[], None]:
    """Time the stream's proto conversions as encode / decode; returns the undo."""
    encode, decode = worker_stream.to_proto, worker_stream.from_proto
    worker_stream.to_proto = recorder.wrap("encode", encode)
    worker_stream.from_proto = recorder.wrap("decode", decode)

    def undo() -> None:
        worker_stream.to_proto, worker_stream.from_proto = encode, decode

    return undo


def instrument(server: EngineCoreServer, client: TimedWorkerClient) -> StepRecorder:
    """Wrap the live engine's scheduler, publish hook and worker client with timers."""
    recorder = StepRecorder(threading.get_ident())
    scheduler = server.servicer.engine.scheduler
    schedule = recorder.wrap("schedule", scheduler.schedule)

    def begin_and_schedule() -> SchedulerOutput:
        recorder.begin_step()
        recorder.current["running"] = len(scheduler.running)
        return schedule()

    scheduler.schedule = begin_and_schedule  # type: ignore[method-assign]
    scheduler.update_from_output = recorder.wrap("update", scheduler.update_from_output)  # type: ignore[method-assign]
    loop = server.servicer.loop
    loop._publish = recorder.wrap("publish", loop._publish)
    client.recorder = recorder
    return recorder


Run = tuple[list[dict[str, float]], dict[str, float]]  # (steady steps, delivery figures)


async def run_scenario(num_running: int, steps: int) -> Run:
    """One run: start the three parts, record `steps` steady decode steps, tear down."""
    ctx = mp.get_context("spawn")
    num_blocks = num_running * (PROMPT_LEN + steps * 4 + 2000) // BLOCK_SIZE + 64
    worker_conn, worker_end = ctx.Pipe()
    worker = ctx.Process(target=worker_process, args=(worker_end, num_blocks), daemon=True)
    worker.start()
    address = f"127.0.0.1:{await asyncio.to_thread(worker_conn.recv)}"
    client = TimedWorkerClient(address)
    config = SchedulerConfig(max_num_seqs=max(num_running, 256))
    engine = await asyncio.to_thread(EngineCore, config, CacheConfig(), [client])
    server = EngineCoreServer("127.0.0.1:0", engine)
    await server.start()
    recorder = instrument(server, client)
    undo = _timed_conversions(recorder)
    client_conn, client_end = ctx.Pipe()
    args = (client_end, f"127.0.0.1:{server.port}", num_running, steps * 4 + 2000)
    clients = ctx.Process(target=client_process, args=args, daemon=True)
    clients.start()
    try:
        await _wait_for_steady_steps(recorder, num_running, steps)
    finally:
        client_conn.send("stop")
        tokens, messages = await asyncio.to_thread(client_conn.recv)
        await server.stop(0.2)
        client.close()
        undo()
        worker_conn.send("stop")
        worker_times = await asyncio.to_thread(worker_conn.recv)
        clients.join(10)
        worker.join(10)
    assert tokens > 0, "the clients received no tokens"
    delivery = {
        "tokens_received": tokens,
        "tokens_per_update": tokens / max(messages, 1),
        "load_average_1m": os.getloadavg()[0],  # the machine is shared: read figures with it
    }
    return _steady(recorder.steps, num_running, worker_times)[:steps], delivery


async def _wait_for_steady_steps(recorder: StepRecorder, num_running: int, steps: int) -> None:
    deadline = time.monotonic() + 300
    while len(_steady(recorder.steps, num_running, {})) < steps:
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not reach a steady decode state")
        await asyncio.sleep(0.2)


def _steady(
    records: list[dict[str, float]], num_running: int, worker_times: dict[int, float]
) -> list[dict[str, float]]:
    """Pure decode steps with all requests running (after warm-up), with derived parts."""
    out = []
    for rec in records[WARMUP_STEPS:]:
        if rec.get("running") != num_running or rec.get("num_tokens") != num_running:
            continue
        if "period" not in rec or "update" not in rec:
            continue
        step = {part: rec.get(part, 0.0) * 1e3 for part in ("schedule", "encode", "decode")}
        step["update"], step["publish"] = rec["update"] * 1e3, rec.get("publish", 0.0) * 1e3
        worker_ms = rec["worker_ms"]
        step["worker_convert"] = worker_times.get(int(rec["step_id"]), 0.0) * 1e3
        blocked = (rec["rpc"] - rec.get("decode", 0.0)) * 1e3  # waiting for the reply
        step["transport"] = max(0.0, blocked - worker_ms - step["worker_convert"])
        step["total"] = rec["period"] * 1e3 - worker_ms
        timed = sum(rec.get(p, 0.0) for p in ("schedule", "encode", "rpc", "decode", "update"))
        step["loop_glue"] = (rec["period"] - timed - rec.get("publish", 0.0)) * 1e3
        step["event_loop_cpu"] = rec["event_loop_cpu"] * 1e3
        out.append(step)
    return out


# ---- report -------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(steps: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median and p90 of every part, in milliseconds."""
    parts = [*PARTS, "total", "event_loop_cpu"]
    return {
        p: {
            "median_ms": statistics.median(s[p] for s in steps),
            "p90_ms": _percentile([s[p] for s in steps], 0.9),
        }
        for p in parts
    }


def best_of(runs: list[Run]) -> dict[str, Any]:
    """The run with the lowest median total (the least disturbed on a shared machine)."""
    summaries = [(summarize(steps), delivery) for steps, delivery in runs]
    best, delivery = min(summaries, key=lambda s: s[0]["total"]["median_ms"])
    return {
        "parts": best,
        "steps": len(runs[0][0]),
        "delivery": delivery,
        "run_total_medians_ms": [s["total"]["median_ms"] for s, _ in summaries],
    }


def table(results: dict[int, dict[str, Any]], compare: dict[str, Any] | None) -> str:
    """Rows = parts; columns = median / p90 per running count (and the baseline's medians)."""
    rows = []
    for part in [*PARTS, "total", "event_loop_cpu"]:
        row: dict[str, Any] = {"part": PART_LABELS[part]}
        for n, res in results.items():
            if compare and str(n) in compare:
                row[f"before p50 @{n}"] = compare[str(n)]["parts"][part]["median_ms"]
            row[f"p50 @{n}"] = res["parts"][part]["median_ms"]
            row[f"p90 @{n}"] = res["parts"][part]["p90_ms"]
        rows.append(row)
    columns = list(rows[0])
    return markdown_table(rows, columns)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--steps", type=int, default=300, help="steady decode steps per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per scenario (best kept)")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--compare", help="an earlier step_overhead.json to show as 'before'")
    args = parser.parse_args(argv)
    results: dict[int, dict[str, Any]] = {}
    for n in args.running:
        results[n] = best_of([asyncio.run(run_scenario(n, args.steps)) for _ in range(args.repeat)])
    compare = json.loads(Path(args.compare).read_text())["results"] if args.compare else None
    report(results, compare, Path(args.out_dir))


def report(
    results: dict[int, dict[str, Any]], compare: dict[str, Any] | None, out_dir: Path
) -> None:
    """Print and write step_overhead.json / .md / .png (the plot: the first running count)."""
    text = (
        "Scheduler + gRPC overhead per engine step (everything except the forward), ms; "
        "target <= 1.5 ms median at 32 running, <= 5 ms at 256\n\n" + table(results, compare)
    )
    for n, res in results.items():
        text += f"\n{n} running: {res['delivery']['tokens_per_update']:.2f} tokens per update\n"
    print(text)
    data = {"target_median_ms": 1.5, "load_average": os.getloadavg(), "results": results}
    if compare:
        data["before"] = compare
    print(f"wrote {write_results('step_overhead', data, text, out_dir)}")
    n = next(iter(results))
    bar_plot(
        out_dir / "step_overhead.png",
        f"Per-step overhead at {n} running (median)",
        [p.replace("_", "\n") for p in [*PARTS, "total"]],
        [results[n]["parts"][p]["median_ms"] for p in [*PARTS, "total"]],
        "ms",
    )


if __name__ == "__main__":
    main()
