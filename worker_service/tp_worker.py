"""Ranks 1..N-1 of a tensor-parallel worker: follow rank 0's commands until told to stop.

Started by rank 0 (`python -m worker_service.tp_worker --rank R --rendezvous-file PATH`,
the WorkerConfig as JSON on stdin), or by hand on another host (`python -m worker_service
--tensor-parallel-size N --tp-rank R --tp-init-method tcp://HOST:PORT`, with the internal
token).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import torch

from services.config import WorkerConfig
from services.flags import add_flags
from services.log import setup_logging
from services.tracing import ObservabilityConfig
from worker_service import parallel
from worker_service.__main__ import WorkerProcess
from worker_service.models.context import forward_context
from worker_service.tp_messages import decode_config
from worker_service.worker import Worker, select_device

log = logging.getLogger(__name__)


def run_rank(config: WorkerConfig, rank: int, how: parallel.Rendezvous) -> None:
    """Join the group as `rank`, load this rank's share of the model, serve rank 0."""
    device = select_device(config.model.device)
    size = config.parallel.tensor_parallel_size
    group = parallel.init_group(rank, size, how, device)
    worker = Worker(config, tp=group)
    worker.thread.call(follow, worker, group)  # the steps on the thread that loaded the model


def follow(worker: Worker, group: parallel.TPGroup) -> None:
    """Do what rank 0 does, command by command (see Worker and ModelRunner.execute_model)."""
    while True:
        command, *args = group.receive()
        if command == "step":
            input_ids, positions, meta = args
            device = worker.device
            meta = parallel.tensors_to(meta, device)
            with torch.inference_mode(), forward_context(meta):
                worker.runner.model(input_ids.to(device), positions.to(device))
        elif command == "memory":
            worker.determine_available_memory()
        elif command == "cache":
            worker.initialize_cache(*args)
        elif command == "stop":
            worker.shutdown()
            return
        else:
            raise RuntimeError(f"unknown tensor parallel command {command!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m worker_service.tp_worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--rendezvous-file", required=True, help="rank 0's private FileStore")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    add_flags(p, WorkerProcess, only=("log_level",))
    add_flags(p, ObservabilityConfig, only=("log_format",))
    args = p.parse_args(argv)
    config = decode_config(sys.stdin.buffer.read())
    setup_logging(f"worker-rank{args.rank}", args.log_level, args.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops us (Ctrl-C reaches the group)
    if args.parent_pid:
        parallel.exit_with_parent(args.parent_pid)
    run_rank(config, args.rank, parallel.LocalRendezvous(args.rendezvous_file))


if __name__ == "__main__":
    main()
