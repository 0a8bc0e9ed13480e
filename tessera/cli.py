"""The `tessera` command line: `tessera serve` (three local services) and friends."""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from gateway.options import add_media_args, media_flags
from services.default_model import served_name
from services.security import API_KEY_ENV, TOKEN_ENV
from tessera.launcher import Launcher, Service, grpc_ok, http_ok
from worker_service.cpu_kernels import add_kernel_args


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve a model: worker + scheduler + gateway on loopback")
    p.add_argument(
        "--model",
        default="default",
        help="HF model directory, or 'default' (SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--served-model-name", default="", help="name clients use (default: from the model)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    add_kernel_args(p)
    p.add_argument("--kv-cache-memory", default="2GiB", help="KV pool budget on CPU, e.g. 2GiB")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=0, help="context length (0: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API")
    p.add_argument("--grpc-port", type=int, default=50052, help="port of the gRPC text API")
    p.add_argument(
        "--scheduler-port", type=int, default=50051, help="loopback port of the scheduler"
    )
    p.add_argument("--worker-port", type=int, default=50061, help="loopback port of the worker")
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
    add_media_args(p)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=serve)


def internal_token() -> str:
    """The token the three services share: TESSERA_INTERNAL_TOKEN when set, else a fresh one."""
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)


def build_services(args: argparse.Namespace, token: str) -> list[Service]:
    """The three services with their flags, in start order; `token` reaches them through
    the environment (not argv, which `ps` shows)."""
    py = sys.executable
    worker_addr = f"127.0.0.1:{args.worker_port}"
    scheduler_addr = f"127.0.0.1:{args.scheduler_port}"
    common = ["--log-level", args.log_level]
    worker = [
        py, "-m", "worker_service", "--model", args.model, "--dtype", args.dtype,
        "--bf16-gemm", args.bf16_gemm, *(["--hf-exact-numerics"] if args.hf_exact_numerics else []),
        "--host", "127.0.0.1", "--port", str(args.worker_port), "--block-size", str(args.block_size),
        "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), *common,
    ]  # fmt: skip
    scheduler = [
        py, "-m", "scheduler_service", "--worker", worker_addr, "--host", "127.0.0.1",
        "--port", str(args.scheduler_port), "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), *common,
        *(["--no-prefix-caching"] if args.no_prefix_caching else []),
    ]  # fmt: skip
    gateway = [
        py, "-m", "gateway", "--scheduler", scheduler_addr, "--model", args.model,
        "--served-model-name", args.served_model_name, "--host", args.host, "--port", str(args.port),
        "--grpc-port", str(args.grpc_port),
        "--max-queued-requests", str(args.max_queued_requests),
        "--drain-timeout", str(args.drain_timeout), *media_flags(args), *common,
    ]  # fmt: skip
    probe_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    env = {TOKEN_ENV: token}
    # the key goes by environment too (`ps` shows argv); none given: the gateway inherits ours
    gateway_env = {**env, API_KEY_ENV: args.api_key} if args.api_key else env
    return [
        Service("worker", worker, grpc_ok(worker_addr), env),
        Service("scheduler", scheduler, grpc_ok(scheduler_addr), env),
        Service(
            "gateway", gateway, http_ok(f"http://{probe_host}:{args.port}/health"), gateway_env
        ),
    ]


def serve(args: argparse.Namespace) -> int:
    services = build_services(args, internal_token())
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
    "multimodal": "multimodal_bench",
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
