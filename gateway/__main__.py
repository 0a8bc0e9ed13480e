"""`python -m gateway`: the OpenAI-compatible REST API and the gRPC text API."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence

from gateway.options import add_chat_args, add_limit_args, add_media_args, limits_from_args
from gateway.server import GatewayServer
from services.config import DEFAULT_MODEL, ROUTINGS, GatewayConfig, parse_bytes
from services.grpc_utils import set_internal_security
from services.hub import add_hub_args, hub_from_args
from services.log import setup_logging
from services.lora_config import add_lora_args, lora_from_args
from services.security import API_KEY_ENV, add_security_args, security_from_args
from services.tracing import add_observability_args, init_tracing, observability_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    p.add_argument(
        "--scheduler",
        action="append",
        default=[],
        help="EngineCore address host:port (default 127.0.0.1:50051); repeat for engine "
        "replicas, or give one DNS name that resolves to one address per replica",
    )
    p.add_argument(
        "--routing",
        default="affinity",
        choices=ROUTINGS,
        help="how requests spread over engine replicas",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model dir or Hub id (org/name) for the tokenizer ('default': embedded)",
    )
    add_hub_args(p)
    p.add_argument(
        "--served-model-name", default="", help="name clients use; empty: the scheduler's"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (HTTP and gRPC)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API")
    p.add_argument(
        "--grpc-port", type=int, default=50052, help="port of the gRPC text API; 0 disables it"
    )
    p.add_argument(
        "--api-key",
        default="",
        help="Bearer token required on /v1, /tokenize, /detokenize and the gRPC text API "
        f"(default: the {API_KEY_ENV} variable, which `ps` does not show)",
    )
    p.add_argument(
        "--max-queued-requests", type=int, default=1024, help="requests in flight before 429"
    )
    p.add_argument(
        "--cors-allow-origin", action="append", default=[], help="allowed CORS origin (repeat)"
    )
    p.add_argument(
        "--max-body-bytes", default="32MiB", help="largest request body or gRPC message (32MiB)"
    )
    p.add_argument(
        "--max-inflight-bytes",
        default="256MiB",
        help="request bytes held at once over all requests; 429 past it (e.g. 256MiB)",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds streams may finish on SIGTERM"
    )
    add_limit_args(p)
    add_chat_args(p)
    add_media_args(p)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_lora_args(p)
    add_security_args(p)  # the gateway's channel to the scheduler
    add_observability_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        scheduler_address=(args.scheduler or ["127.0.0.1:50051"])[0],
        extra_scheduler_addresses=tuple(args.scheduler[1:]),
        routing=args.routing,
        model=args.model,
        hub=hub_from_args(args),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV, ""),
        max_queued_requests=args.max_queued_requests,
        cors_allow_origins=tuple(args.cors_allow_origin),
        max_body_bytes=parse_bytes(args.max_body_bytes),
        max_inflight_bytes=parse_bytes(args.max_inflight_bytes),
        drain_timeout_s=args.drain_timeout,
        limit_images_per_prompt=args.limit_images_per_prompt,
        max_image_bytes=parse_bytes(args.max_image_bytes),
        max_image_pixels=args.max_image_pixels,
        allowed_media_domains=tuple(d.lower() for d in args.allowed_media_domains),
        media_fetch_timeout_s=args.media_fetch_timeout,
        max_image_aspect_ratio=args.max_image_aspect_ratio,
        allowed_media_networks=tuple(args.allowed_media_networks),
        image_transport=args.image_transport,
        limits=limits_from_args(args),
        chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        lora=lora_from_args(args),
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        observability = observability_from_args(args)
        setup_logging("gateway", args.log_level, observability.log_format)
        init_tracing("gateway", observability)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    set_internal_security(security_from_args(args))
    asyncio.run(_serve(config_from_args(args)))


async def _serve(config: GatewayConfig) -> None:
    await GatewayServer(config).serve()  # built inside the loop: its gRPC channel binds to it


if __name__ == "__main__":
    main()
