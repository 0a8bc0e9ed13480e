"""The `tessera` command line: `tessera serve` (three local services) and friends."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from dataclasses import replace

from services.config import (
    API_KEY_ENV,
    SCHEDULER_CACHE_FIELDS,
    TOKEN_ENV,
    CacheConfig,
    GatewayConfig,
    HubConfig,
    ModelConfig,
    ParallelConfig,
    RequestLimits,
    SchedulerConfig,
    WorkerConfig,
    parse_bytes,
)
from services.default_model import served_name
from services.flags import add_flags, from_args, to_flags
from services.hub import is_hub_id, resolve_hub_model
from services.lora_config import LoRAConfig
from services.pooling import add_runner_args, runner_from_args
from services.tracing import ObservabilityConfig, require_packages
from tessera.data_parallel import Topology, data_parallel_replicas
from tessera.launcher import (
    LIVENESS_TIMEOUT_S,
    Launcher,
    Service,
    grpc_ok,
    grpc_up,
    http_ok,
    http_up,
)


def _serve_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str = "serve"
) -> None:
    helps = {
        "serve": "serve a model: worker + scheduler + gateway on loopback",
        "engine": "one engine replica (worker + scheduler; --host is the scheduler's), no gateway",
    }
    p = sub.add_parser(name, help=helps[name])
    add_flags(p, ModelConfig, skip=("device", "seed"))
    add_runner_args(p)
    add_flags(p, CacheConfig, skip=("gpu_memory_utilization", "num_blocks_override"))
    add_flags(
        p,
        SchedulerConfig,
        only=("max_num_seqs", "max_num_batched_tokens", "target_tpot_ms", "speculative_config"),
    )
    add_flags(p, ParallelConfig, only=("tensor_parallel_size", "enable_expert_parallel"))
    add_flags(p, GatewayConfig, skip=("cors_allow_origins", "max_body_bytes", "max_inflight_bytes"))
    for cls in (HubConfig, RequestLimits, LoRAConfig, ObservabilityConfig, Topology):
        add_flags(p, cls)
    p.set_defaults(func=serve if name == "serve" else engine, engine_only=name == "engine")


def internal_token() -> str:
    """The token the three services share: TESSERA_INTERNAL_TOKEN when set, else a fresh one."""
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)


def build_services(args: argparse.Namespace, token: str) -> list[Service]:
    """The services with their flags, in start order: each engine replica's worker and
    scheduler, then the gateway. The configs are built (and checked) here, before anything
    starts, and handed on as the flags that reproduce them; `token` and the API key reach the
    services through the environment (not argv, which `ps` shows)."""
    py = sys.executable
    model, name = _model_source(args)
    source = {"model": model, "served_model_name": name, "hub": HubConfig()}
    worker = from_args(
        WorkerConfig,
        args,
        model=from_args(ModelConfig, args, runner=runner_from_args(args), **source),
    )
    scheduler = from_args(SchedulerConfig, args)
    gateway = from_args(GatewayConfig, args, **source)
    observability = from_args(ObservabilityConfig, args)
    if observability.otlp_traces_endpoint:
        require_packages()
    common = ["--log-level", args.log_level, *to_flags(observability)]
    replicas = data_parallel_replicas(args, args.host if args.engine_only else "127.0.0.1")
    env = {TOKEN_ENV: token}
    services: list[Service] = []
    for replica in replicas:
        worker_addr = f"127.0.0.1:{replica.worker_port}"
        scheduler_addr = f"127.0.0.1:{replica.scheduler_port}"
        cache = replace(worker.cache, kv_cache_memory_bytes=parse_bytes(replica.kv_cache_memory))
        worker_argv = [
            py, "-m", "worker_service", "--host", "127.0.0.1", "--port", str(replica.worker_port),
            "--runner", worker.model.runner, *replica.worker_flags, *common,
            *to_flags(replace(worker, cache=cache), skip=SCHEDULER_CACHE_FIELDS),
        ]  # fmt: skip
        scheduler_argv = [
            py, "-m", "scheduler_service", "--worker", worker_addr, "--host", replica.scheduler_host,
            "--port", str(replica.scheduler_port), *common, *to_flags(scheduler),
            *to_flags(cache, only=SCHEDULER_CACHE_FIELDS),
        ]  # fmt: skip
        services += [
            Service(f"worker{replica.suffix}", worker_argv, grpc_up(worker_addr),
                    grpc_up(worker_addr, LIVENESS_TIMEOUT_S), env,
                    (("127.0.0.1", replica.worker_port),)),
            Service(f"scheduler{replica.suffix}", scheduler_argv, grpc_ok(scheduler_addr),
                    grpc_up(scheduler_addr, LIVENESS_TIMEOUT_S), env,
                    ((replica.scheduler_host, replica.scheduler_port),)),
        ]  # fmt: skip
    schedulers = [f"--scheduler=127.0.0.1:{r.scheduler_port}" for r in replicas]
    gateway_argv = [py, "-m", "gateway", *schedulers, *common, *to_flags(gateway, skip=["api_key"])]
    probe_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    health = f"http://{probe_host}:{args.port}/health"
    # the key goes by environment too (`ps` shows argv); none given: the gateway inherits ours
    gateway_env = {**env, API_KEY_ENV: args.api_key} if args.api_key else env
    listens = ((args.host, args.port), (args.host, args.grpc_port))
    services.append(
        Service("gateway", gateway_argv, http_ok(health), http_up(health), gateway_env, listens)
    )
    return services


def _model_source(args: argparse.Namespace) -> tuple[str, str]:
    """--model and --served-model-name for the services: a Hub id is found in the cache or
    downloaded here, once, and the services load the snapshot under the id's name."""
    if not is_hub_id(args.model):
        return args.model, args.served_model_name
    snapshot = resolve_hub_model(args.model, from_args(HubConfig, args))
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
