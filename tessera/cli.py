"""The `tessera` command line: `tessera serve` (three local services) and friends."""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from gateway.options import (
    add_chat_args,
    add_limit_args,
    add_media_args,
    chat_flags,
    limit_flags,
    media_flags,
)
from services.config import SpeculativeConfig, add_kv_cache_dtype_arg, add_speculative_arg
from services.default_model import served_name
from services.hub import add_hub_args, hub_from_args, is_hub_id, resolve_hub_model
from services.lora_config import add_lora_args, lora_flags
from services.pooling import add_runner_args, runner_from_args
from services.security import API_KEY_ENV, TOKEN_ENV
from services.tracing import add_observability_args, observability_flags
from tessera.data_parallel import add_data_parallel_args, data_parallel_replicas
from tessera.launcher import (
    LIVENESS_TIMEOUT_S,
    Launcher,
    Service,
    grpc_ok,
    grpc_up,
    http_ok,
    http_up,
)
from worker_service.cpu_kernels import add_kernel_args


def _serve_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str = "serve"
) -> None:
    helps = {
        "serve": "serve a model: worker + scheduler + gateway on loopback",
        "engine": "one engine replica (worker + scheduler; --host is the scheduler's), no gateway",
    }
    p = sub.add_parser(name, help=helps[name])
    p.add_argument(
        "--model",
        default="default",
        help="HF model directory, Hub id (org/name), or 'default' (SmolLM2-135M-Instruct)",
    )
    add_hub_args(p)
    p.add_argument(
        "--served-model-name", default="", help="name clients use (default: from the model)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    add_kernel_args(p)
    add_runner_args(p)
    p.add_argument(
        "--kv-cache-memory",
        default="2GiB",
        help="KV pool budget on CPU, e.g. 2GiB (split evenly over data-parallel replicas)",
    )
    add_kv_cache_dtype_arg(p)
    p.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="each worker's torch CPU threads; 0: all cores (split over data-parallel replicas)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=0, help="context length (0: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API")
    p.add_argument("--grpc-port", type=int, default=50052, help="port of the gRPC text API")
    p.add_argument(
        "--scheduler-port",
        type=int,
        default=50051,
        help="port of the scheduler (replica i of --data-parallel-size: + 100 i)",
    )
    p.add_argument(
        "--worker-port",
        type=int,
        default=50061,
        help="loopback port of the worker (replica i: + 100 i)",
    )
    p.add_argument("--api-key", default="", help="require this bearer token")
    p.add_argument(
        "--max-queued-requests", type=int, default=1024, help="admission limit (429 past it)"
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to drain streams on stop"
    )
    p.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds each service may take to start"
    )
    add_limit_args(p)
    add_media_args(p)
    add_chat_args(p)
    p.add_argument("--log-level", default="INFO")
    add_observability_args(p)
    add_data_parallel_args(p)
    add_lora_args(p)
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="worker ranks the model is split over"
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE: split the experts over the ranks by expert id (default: by intermediate size)",
    )
    add_speculative_arg(p)
    p.set_defaults(func=serve if name == "serve" else engine, engine_only=name == "engine")


def internal_token() -> str:
    """The token the three services share: TESSERA_INTERNAL_TOKEN when set, else a fresh one."""
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)


def build_services(args: argparse.Namespace, token: str) -> list[Service]:
    """The services with their flags, in start order: each engine replica's worker and
    scheduler, then the gateway; `token` reaches them through the environment (not argv,
    which `ps` shows)."""
    py = sys.executable
    spec = SpeculativeConfig.parse(args.speculative_config)  # ValueError before anything starts
    spec_flags = ["--speculative-config", spec.to_json()] if spec is not None else []
    replicas = data_parallel_replicas(args, args.host if args.engine_only else "127.0.0.1")
    common = ["--log-level", args.log_level, *observability_flags(args)]
    model, name = _model_source(args)
    lora = lora_flags(args)  # every service takes them
    env = {TOKEN_ENV: token}
    services: list[Service] = []
    for replica in replicas:
        worker_addr = f"127.0.0.1:{replica.worker_port}"
        scheduler_addr = f"127.0.0.1:{replica.scheduler_port}"
        worker = [
            py, "-m", "worker_service", "--model", model, "--served-model-name", name, "--dtype", args.dtype,
            "--bf16-gemm", args.bf16_gemm, "--quantization", args.quantization,
            "--quantization-group-size", str(args.quantization_group_size), *(["--hf-exact-numerics"] if args.hf_exact_numerics else []),
            "--host", "127.0.0.1", "--port", str(replica.worker_port), "--block-size", str(args.block_size),
            "--kv-cache-memory", replica.kv_cache_memory, "--kv-cache-dtype", args.kv_cache_dtype,
            "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), *common,
            "--tensor-parallel-size", str(args.tensor_parallel_size), *replica.worker_flags,
            "--runner", runner_from_args(args),
            *(["--enable-expert-parallel"] if args.enable_expert_parallel else []),
            *spec_flags, *lora,
        ]  # fmt: skip
        scheduler = [
            py, "-m", "scheduler_service", "--worker", worker_addr, "--host", replica.scheduler_host,
            "--port", str(replica.scheduler_port), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), *common,
            *(["--no-prefix-caching"] if args.no_prefix_caching else []), *spec_flags, *lora,
        ]  # fmt: skip
        services += [
            Service(f"worker{replica.suffix}", worker, grpc_up(worker_addr),
                    grpc_up(worker_addr, LIVENESS_TIMEOUT_S), env),
            Service(f"scheduler{replica.suffix}", scheduler, grpc_ok(scheduler_addr),
                    grpc_up(scheduler_addr, LIVENESS_TIMEOUT_S), env),
        ]  # fmt: skip
    schedulers = [f"--scheduler=127.0.0.1:{r.scheduler_port}" for r in replicas]
    gateway = [
        py, "-m", "gateway", *schedulers, "--routing", args.routing, "--model", model,
        "--served-model-name", name, "--host", args.host, "--port", str(args.port),
        "--grpc-port", str(args.grpc_port),
        "--max-queued-requests", str(args.max_queued_requests),
        "--drain-timeout", str(args.drain_timeout), *limit_flags(args), *media_flags(args),
        *chat_flags(args),
        *common, *lora,
    ]  # fmt: skip
    probe_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    health = f"http://{probe_host}:{args.port}/health"
    # the key goes by environment too (`ps` shows argv); none given: the gateway inherits ours
    gateway_env = {**env, API_KEY_ENV: args.api_key} if args.api_key else env
    services.append(Service("gateway", gateway, http_ok(health), http_up(health), gateway_env))
    return services


def _model_source(args: argparse.Namespace) -> tuple[str, str]:
    """--model and --served-model-name for the services: a Hub id is found in the cache or
    downloaded here, once, and the services load the snapshot under the id's name."""
    if not is_hub_id(args.model):
        return args.model, args.served_model_name
    snapshot = resolve_hub_model(args.model, hub_from_args(args))
    return str(snapshot), args.served_model_name or args.model


def engine(args: argparse.Namespace) -> int:
    """`tessera engine`: one engine replica (worker + scheduler) supervised, no gateway; the
    scheduler listens on --host:--scheduler-port, the worker on loopback. A container of the
    scalable engine tier (compose.yaml); gateways find replicas by DNS."""
    if args.data_parallel_size != 1:
        print("tessera: engine runs one replica; scale the containers instead", file=sys.stderr)
        return 2
    try:
        services = build_services(args, internal_token())[:-1]  # all but the gateway
    except (ValueError, FileNotFoundError) as exc:
        print(f"tessera: {exc}", file=sys.stderr)
        return 2
    address = f"{args.host}:{args.scheduler_port}"

    def announce() -> None:
        print(f"tessera: engine replica serving EngineCore at {address}", flush=True)

    return Launcher(services, args.start_timeout, args.drain_timeout).run(announce)


def serve(args: argparse.Namespace) -> int:
    try:
        services = build_services(args, internal_token())
    except (ValueError, FileNotFoundError) as exc:
        print(f"tessera: {exc}", file=sys.stderr)
        return 2
    url = f"http://{args.host}:{args.port}/v1"
    name = args.served_model_name or served_name(args.model)

    def announce() -> None:
        print(
            f"tessera: serving {name} at {url} (gRPC text API on :{args.grpc_port})",
            flush=True,
        )

    return Launcher(services, args.start_timeout, args.drain_timeout).run(announce)


BENCHMARKS = {
    "all": "run_all",
    "offline": "offline_bench",
    "serve": "serve_bench",
    "decode": "decode_bench",
    "scheduler": "scheduler_bench",
    "dp": "dp_bench",
    "multimodal": "multimodal_bench",
    "spec": "spec_decode",
    "lora": "lora_bench",
}


def _bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark (results in bench-results/)")
    p.add_argument("mode", choices=list(BENCHMARKS), help="which benchmark; `all` is `make bench`")
    p.add_argument(
        "args", nargs=argparse.REMAINDER, help="passed to the benchmark (see its --help)"
    )
    p.set_defaults(func=bench)


def bench(args: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(f"benchmarks.{BENCHMARKS[args.mode]}").main(args.args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _serve_parser(sub, "engine")
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
