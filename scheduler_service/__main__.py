"""`python -m scheduler_service --worker HOST:PORT ...`: serve the EngineCore over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_service.engine import EngineCore
from scheduler_service.service import EngineCoreServer
from scheduler_service.tracing import RequestSpans
from scheduler_service.worker_client import GrpcWorkerClient
from services.config import (
    HOST,
    SCHEDULER_CACHE_FIELDS,
    SCHEDULER_PORT,
    CacheConfig,
    SchedulerConfig,
    SecurityConfig,
)
from services.flags import add_flags, flag, from_args
from services.grpc_utils import health_status, set_internal_security
from services.log import LOG_LEVEL, setup_logging
from services.lora_config import LoRAConfig
from services.security import security_from_args
from services.tracing import ObservabilityConfig, init_tracing, observability_from_args, tracer

log = logging.getLogger("scheduler_service")


@dataclass(frozen=True)
class SchedulerProcess:
    """`python -m scheduler_service` flags beyond its configs: where it listens, its workers."""

    worker: tuple[str, ...] = flag(
        (),
        "Address of a worker rank (repeat for several ranks; rank 0 first).",
        nargs="append",
        metavar="HOST:PORT",
        required=True,
    )
    host: str = HOST.field()
    port: int = flag(SCHEDULER_PORT, "gRPC port (0: pick a free one).")
    worker_wait_s: float = flag(600.0, "How long to wait at start for the workers to answer.")
    step_timeout_s: float = flag(600.0, "A worker silent this long during a step counts as lost.")
    log_level: str = LOG_LEVEL.field()


FLAGS = (SchedulerProcess, SchedulerConfig, LoRAConfig, SecurityConfig, ObservabilityConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_service",
        description="Tessera scheduler: the EngineCore gRPC service (continuous batching, "
        "paged KV blocks, prefix caching) driving one or more workers.",
    )
    for cls in FLAGS:
        add_flags(p, cls)
    add_flags(p, CacheConfig, only=SCHEDULER_CACHE_FIELDS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def configs(args: argparse.Namespace) -> tuple[SchedulerConfig, CacheConfig]:
    """The config dataclasses the flags describe (ValueError on bad values)."""
    return from_args(SchedulerConfig, args), from_args(CacheConfig, args)


def wait_for_workers(addresses: Sequence[str], timeout_s: float) -> None:
    """Block until every worker answers its health check (model loaded; it reports SERVING
    only after our KV handshake); TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for address in addresses:
        while health_status(address, timeout_s=2.0) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {address} did not report SERVING in {timeout_s:.0f}s")
            time.sleep(0.5)


async def serve(args: argparse.Namespace) -> None:
    scheduler_config, cache_config = configs(args)
    await asyncio.to_thread(wait_for_workers, args.worker, args.worker_wait_s)
    workers = [GrpcWorkerClient(a, step_timeout_s=args.step_timeout_s) for a in args.worker]
    engine = await asyncio.to_thread(EngineCore, scheduler_config, cache_config, workers)
    server = EngineCoreServer(f"{args.host}:{args.port}", engine, args.worker)
    if tracer() is not None:
        spans = RequestSpans(tracer(), observability_from_args(args).every_step)
        server.servicer.spans, engine.on_schedule = spans, spans.tag_step
    await server.start()
    info = engine.server_info()
    log.info(
        "EngineCore serving on %s:%d: model %s, %d blocks of %d tokens, max_model_len %d",
        args.host, server.port, info.model_name, info.num_blocks, info.block_size,
        info.max_model_len,
    )  # fmt: skip
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await server.stop()
    for worker in workers:
        worker.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        observability = observability_from_args(args)
        setup_logging("scheduler", args.log_level, observability.log_format)
        init_tracing("scheduler", observability)
        set_internal_security(security_from_args(args))
        asyncio.run(serve(args))
    except (ValueError, TimeoutError, RuntimeError) as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
