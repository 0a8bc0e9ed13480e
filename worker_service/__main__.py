"""`python -m worker_service`: load a model and serve the tessera.v1.Worker gRPC service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from services.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    WorkerConfig,
    add_kv_cache_dtype_arg,
    add_speculative_arg,
    parse_bytes,
)
from services.grpc_utils import set_internal_security
from services.hub import add_hub_args, hub_from_args
from services.log import setup_logging
from services.lora_config import add_lora_args, lora_from_args
from services.pooling import add_runner_args, runner_from_args
from services.security import add_security_args, security_from_args
from services.tracing import add_observability_args, init_tracing, observability_from_args
from worker_service.cpu_kernels import add_kernel_args
from worker_service.server import build_server

log = logging.getLogger("worker_service")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker_service", description=__doc__)
    p.add_argument(
        "--model",
        default="default",
        help="HF model directory, Hub id (org/name), or 'default' (SmolLM2-135M-Instruct)",
    )
    add_hub_args(p)
    p.add_argument("--served-model-name", default="", help="name reported in ModelInfo")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "float16"],
        help="weights and activations: bfloat16 (fast) or float32 (exact)",
    )
    add_kernel_args(p)
    add_runner_args(p)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=50061, help="gRPC port (0: pick a free one)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-memory", default="2GiB", help="CPU KV pool budget (e.g. 2GiB, 512MiB)"
    )
    add_kv_cache_dtype_arg(p)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="GPU: fraction of device memory for weights, activations and the KV pool",
    )
    p.add_argument("--max-model-len", type=int, default=0, help="0: the model's own")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="largest step the runner prepares for (tokens)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "triton", "cpu", "reference"],
        help="auto: triton on CUDA, cpu otherwise",
    )
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads; 0: all cores")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the generator shared by unseeded requests"
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_speculative_arg(p)
    add_security_args(p)
    add_parallel_args(p)
    add_lora_args(p)
    add_observability_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism flags (worker_service.parallel)."""
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks the model is split over"
    )
    p.add_argument(
        "--tp-init-method",
        default="",
        help="where ranks started by hand meet (with --tp-no-spawn on rank 0, and on ranks "
        "R > 0): tcp://HOST:PORT, served by rank 0 behind the internal token (default: "
        "MASTER_ADDR/MASTER_PORT); ranks rank 0 starts itself meet through a private file",
    )
    p.add_argument(
        "--tp-rank",
        type=int,
        default=0,
        help="this process's rank; R > 0 joins rank 0's group (ranks on other hosts)",
    )
    p.add_argument(
        "--tp-no-spawn",
        action="store_true",
        help="rank 0 does not start ranks 1..N-1 itself (they run elsewhere)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split MoE experts over the ranks by expert id (default: by intermediate size)",
    )


def build_config(args: argparse.Namespace) -> WorkerConfig:
    """WorkerConfig from the command line (ValueError on invalid values)."""
    return WorkerConfig(
        model=ModelConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            dtype=args.dtype,
            bf16_gemm=args.bf16_gemm,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            hf_exact_numerics=args.hf_exact_numerics,
            max_model_len=args.max_model_len,
            device=args.device,
            seed=args.seed,
            hub=hub_from_args(args),
            runner=runner_from_args(args),
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=parse_bytes(args.kv_cache_memory),
            gpu_memory_utilization=args.gpu_memory_utilization,
            cache_dtype=args.kv_cache_dtype,
        ),
        attention_backend=args.attention_backend,
        num_threads=args.num_threads,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            init_method=args.tp_init_method,
            spawn_ranks=not args.tp_no_spawn,
            enable_expert_parallel=args.enable_expert_parallel,
        ),
        speculative_config=SpeculativeConfig.parse(args.speculative_config),
        lora=lora_from_args(args),
    )


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
