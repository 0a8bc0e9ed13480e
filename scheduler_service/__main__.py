"""`python -m scheduler_service --worker HOST:PORT ...`: serve the EngineCore over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence

from scheduler_service.engine import EngineCore
from scheduler_service.service import EngineCoreServer
from scheduler_service.tracing import RequestSpans
from scheduler_service.worker_client import GrpcWorkerClient
from services.config import CacheConfig, SchedulerConfig, SpeculativeConfig, add_speculative_arg
from services.grpc_utils import health_status, set_internal_security
from services.log import setup_logging
from services.lora_config import add_lora_args, lora_from_args
from services.security import add_security_args, security_from_args
from services.tracing import add_observability_args, init_tracing, observability_from_args, tracer

log = logging.getLogger("scheduler_service")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_service",
        description="Tessera scheduler: the EngineCore gRPC service (continuous batching, "
        "paged KV blocks, prefix caching) driving one or more workers.",
    )
    p.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="address of a worker rank (repeat for several ranks; rank 0 first)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step"
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="cap on one prompt's chunk per step (0: only the budget caps it)",
    )
    p.add_argument(
        "--max-num-encoder-tokens",
        type=int,
        default=0,
        help="image placeholder tokens encoded per step (0: the token budget)",
    )
    p.add_argument(
        "--policy", choices=["fcfs", "priority"], default="fcfs", help="waiting-queue order"
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="admit a prompt only when it fits the step budget whole",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="schedule each step only after the previous one's output is back "
        "(default: schedule step n+1 while the workers run step n)",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="force the KV pool size in blocks (0: decided by the memory handshake)",
    )
    p.add_argument(
        "--worker-wait-s",
        type=float,
        default=600.0,
        help="how long to wait at start for the workers to answer",
    )
    p.add_argument(
        "--step-timeout-s",
        type=float,
        default=600.0,
        help="a worker silent this long during a step counts as lost",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")  # fmt: skip
    add_speculative_arg(p)
    add_security_args(p)
    add_lora_args(p)
    add_observability_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def configs(args: argparse.Namespace) -> tuple[SchedulerConfig, CacheConfig]:
    """The config dataclasses the flags describe (ValueError on bad values)."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=not args.no_chunked_prefill,
        policy=args.policy,
        async_scheduling=not args.no_async_scheduling,
        max_num_encoder_tokens=args.max_num_encoder_tokens,
        speculative_config=SpeculativeConfig.parse(args.speculative_config),
        lora=lora_from_args(args),
    )
    cache_config = CacheConfig(
        enable_prefix_caching=not args.no_prefix_caching, num_blocks_override=args.num_blocks
    )
    return scheduler_config, cache_config


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
