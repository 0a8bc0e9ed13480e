"""`python -m tests.scheduler.fake_worker_server --port N`: the fake worker behind the real Worker service."""

from __future__ import annotations

import argparse
import asyncio
import signal

from tests.scheduler.fake_worker import FakeWorker
from worker_service.server import build_server


async def serve(port: int, step_delay_s: float) -> None:
    server = build_server(f"127.0.0.1:{port}", FakeWorker(step_delay_s=step_delay_s))
    await server.start()
    await server.set_serving(True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.step_delay_s))
