"""`python -m worker_service`: load a model and serve the tessera.v1.Worker gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass

from services.config import (
    HOST,
    SCHEDULER_CACHE_FIELDS,
    WORKER_PORT,
    CacheConfig,
    HubConfig,
    ModelConfig,
    ParallelConfig,
    SecurityConfig,
    WorkerConfig,
)
from services.flags import add_flags, flag, from_args
from services.grpc_utils import set_internal_security
from services.log import LOG_LEVEL, setup_logging
from services.lora_config import LoRAConfig
from services.pooling import add_runner_args, runner_from_args
from services.security import security_from_args
from services.tracing import ObservabilityConfig, init_tracing, observability_from_args
from worker_service.server import build_server

log = logging.getLogger("worker_service")


@dataclass(frozen=True)
class WorkerProcess:
    """`python -m worker_service` flags beyond WorkerConfig: where it listens, which rank."""

    host: str = HOST.field()
    port: int = flag(WORKER_PORT, "gRPC port (0: pick a free one).")
    tp_rank: int = flag(
        0, "This process's rank; R > 0 joins rank 0's group (ranks on other hosts)."
    )
    log_level: str = LOG_LEVEL.field()


FLAGS = (
    WorkerProcess, ModelConfig, HubConfig, WorkerConfig, ParallelConfig, LoRAConfig,
    SecurityConfig, ObservabilityConfig,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker_service", description=__doc__)
    for cls in FLAGS:
        add_flags(p, cls)
    add_flags(p, CacheConfig, skip=SCHEDULER_CACHE_FIELDS)
    add_runner_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_config(args: argparse.Namespace) -> WorkerConfig:
    """WorkerConfig from the command line (ValueError on invalid values)."""
    model = from_args(ModelConfig, args, runner=runner_from_args(args))
    return from_args(WorkerConfig, args, model=model)


def run_rank_by_hand(config: WorkerConfig, rank: int) -> None:
    """Rank R > 0 on its own: join rank 0's token-guarded rendezvous and follow it."""
    from worker_service.parallel import remote_rendezvous
    from worker_service.tp_worker import run_rank

    if rank >= config.parallel.tensor_parallel_size:
        raise ValueError("--tp-rank must be below --tensor-parallel-size")
    run_rank(config, rank, remote_rendezvous(config.parallel.init_method))


def _set_soon(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
    loop.call_soon_threadsafe(event.set)


async def serve(config: WorkerConfig, address: str) -> None:
    """Load the model, serve until SIGTERM/SIGINT or a Shutdown call, then stop cleanly."""
    from worker_service.worker import Worker

    worker = await asyncio.to_thread(Worker, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = build_server(address, worker, on_shutdown=lambda: _set_soon(loop, stop))
    await server.set_serving(False)  # SERVING once the scheduler's InitializeCache is done
    await server.start()
    log.info("worker serving on %s:%d", address.rsplit(":", 1)[0], server.port)
    await stop.wait()
    log.info("stopping")
    await server.stop(grace_s=5.0)
    worker.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        observability = observability_from_args(args)
        setup_logging("worker", args.log_level, observability.log_format)
        init_tracing("worker", observability)
        config = build_config(args)
        set_internal_security(security_from_args(args))
        if args.tp_rank > 0:  # a rank started by hand: no gRPC service, follow rank 0
            run_rank_by_hand(config, args.tp_rank)
            return
        asyncio.run(serve(config, f"{args.host}:{args.port}"))
    except (ValueError, FileNotFoundError, OSError) as exc:
        log.error("%s", exc)
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
