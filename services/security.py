"""Credentials for the gRPC services: bearer-token checks, TLS credentials, command-line flags.

The internal token comes from `--internal-token` or, better (argv shows in `ps`), the
TESSERA_INTERNAL_TOKEN environment variable, read when a service starts, not at import.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

import grpc

from services.config import SecurityConfig

TOKEN_ENV = "TESSERA_INTERNAL_TOKEN"
API_KEY_ENV = "TESSERA_API_KEY"  # the gateway's client API key, when --api-key is not given


def bearer_matches(header: str, token: str) -> bool:
    """True when an `authorization` header value is `Bearer <token>` (constant-time compare)."""
    return hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def add_security_args(p: argparse.ArgumentParser) -> None:
    """The internal token and TLS flags, shared by the three services."""
    p.add_argument(
        "--internal-token",
        default="",
        help=f"shared token of the internal services (prefer the {TOKEN_ENV} variable)",
    )
    p.add_argument("--tls-cert", default="", help="PEM certificate of this service (enables TLS)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-ca", default="", help="PEM CA: verify peers with it (servers: mutual TLS)"
    )
    p.add_argument(
        "--tls-server-name", default="", help="name to verify the peer certificate against"
    )


def security_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> SecurityConfig:
    """The SecurityConfig the flags (and TESSERA_INTERNAL_TOKEN) describe."""
    env = os.environ if environ is None else environ
    return SecurityConfig(
        token=args.internal_token or env.get(TOKEN_ENV, ""),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        tls_server_name=args.tls_server_name,
    )


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials:
    """TLS server credentials; with tls_ca, clients must present a certificate it signed."""
    if not config.tls_cert:
        raise ValueError("a TLS server needs tls_cert and tls_key")
    pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
    ca = _read(config.tls_ca)
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=bool(ca))


def channel_credentials(config: SecurityConfig) -> grpc.ChannelCredentials:
    """TLS channel credentials: verify with tls_ca, present tls_cert/tls_key when given."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.tls_ca),
        private_key=_read(config.tls_key),
        certificate_chain=_read(config.tls_cert),
    )
