"""`python -m gateway`: the OpenAI-compatible REST API and the gRPC text API."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.server import GatewayServer
from services.config import API_KEY_ENV, GatewayConfig, HubConfig, RequestLimits, SecurityConfig
from services.flags import add_flags, flag, from_args
from services.grpc_utils import set_internal_security
from services.log import LOG_LEVEL, setup_logging
from services.lora_config import LoRAConfig
from services.security import security_from_args
from services.tracing import ObservabilityConfig, init_tracing, observability_from_args


@dataclass(frozen=True)
class GatewayProcess:
    """`python -m gateway` flags beyond GatewayConfig."""

    scheduler: tuple[str, ...] = flag(
        (),
        f"EngineCore address host:port (default {GatewayConfig.scheduler_address}); repeat for "
        "engine replicas, or give one DNS name that resolves to one address per replica.",
        nargs="append",
    )
    log_level: str = LOG_LEVEL.field()


FLAGS = (
    GatewayProcess, GatewayConfig, HubConfig, RequestLimits, LoRAConfig, SecurityConfig,
    ObservabilityConfig,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    for cls in FLAGS:
        add_flags(p, cls)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    schedulers = args.scheduler or [GatewayConfig.scheduler_address]
    return from_args(
        GatewayConfig,
        args,
        scheduler_address=schedulers[0],
        extra_scheduler_addresses=tuple(schedulers[1:]),
        api_key=args.api_key or os.environ.get(API_KEY_ENV, ""),
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
