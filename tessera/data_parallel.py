"""`tessera serve --data-parallel-size D`: D engine replicas (scheduler + worker pairs).

Replica i listens on `--scheduler-port + 100 i` and `--worker-port + 100 i` (loopback),
gets 1/D of `--kv-cache-memory` and, on CPU, 1/D of the cores; the gateway gets
one `--scheduler` flag per replica and routes by prefix affinity (`--routing`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.config import SCHEDULER_PORT, WORKER_PORT, parse_bytes
from services.flags import flag
from services.log import LOG_LEVEL

PORT_STRIDE = 100  # replica i's ports are the first replica's + PORT_STRIDE * i


@dataclass(frozen=True)
class EngineReplica:
    """Ports and shares of one scheduler + worker pair."""

    index: int
    scheduler_host: str  # where the scheduler listens (loopback under `tessera serve`)
    scheduler_port: int
    worker_port: int
    kv_cache_memory: str  # bytes, as the worker's --kv-cache-memory takes them
    worker_flags: tuple[str, ...]  # extra worker flags (thread share)
    suffix: str  # service name suffix: "" with one replica, "-i" with several


@dataclass(frozen=True)
class Topology:
    """`tessera serve` / `tessera engine` flags beyond the services' own: replicas, ports."""

    data_parallel_size: int = flag(
        1, "Engine replicas (scheduler + worker pairs) behind the one gateway."
    )
    scheduler_port: int = flag(
        SCHEDULER_PORT,
        f"Port of the scheduler (replica i of --data-parallel-size: + {PORT_STRIDE} i).",
    )
    worker_port: int = flag(
        WORKER_PORT, f"Loopback port of the worker (replica i: + {PORT_STRIDE} i)."
    )
    worker_threads: int = flag(
        0, "Each worker's torch CPU threads; 0: all cores (split over data-parallel replicas)."
    )
    start_timeout: float = flag(300.0, "Seconds each service may take to start.")
    log_level: str = LOG_LEVEL.field()


def data_parallel_replicas(
    args: argparse.Namespace, scheduler_host: str = "127.0.0.1"
) -> list[EngineReplica]:
    """The replicas `args` ask for; ValueError when two services would share a port (the
    gateway's may be 0: any free one) or an engine port is out of range."""
    size = args.data_parallel_size
    if size < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    schedulers = [args.scheduler_port + PORT_STRIDE * i for i in range(size)]
    workers = [args.worker_port + PORT_STRIDE * i for i in range(size)]
    engines = [*schedulers, *workers]  # probed at their numbers: 0 (any free port) won't do
    ports = [*engines, *(p for p in (args.port, args.grpc_port) if p)]
    if len(set(ports)) < len(ports) or max(ports) > 65535 or min(engines) < 1:
        raise ValueError(
            f"ports collide or are out of range: schedulers {schedulers}, workers {workers}, "
            f"gateway {args.port} and {args.grpc_port}"
        )
    kv = str(parse_bytes(args.kv_cache_memory) // size) if size > 1 else args.kv_cache_memory
    threads = args.worker_threads or (max(1, (os.cpu_count() or 1) // size) if size > 1 else 0)
    flags = ("--num-threads", str(threads)) if threads else ()
    return [
        EngineReplica(
            i, scheduler_host, schedulers[i], workers[i], kv, flags, f"-{i}" if size > 1 else ""
        )
        for i in range(size)
    ]
