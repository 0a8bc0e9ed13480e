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

from services.config import API_KEY_ENV, TOKEN_ENV, SecurityConfig
from services.flags import from_args

__all__ = ["API_KEY_ENV", "TOKEN_ENV"]  # re-exported: where the services read them


def bearer_matches(header: str, token: str) -> bool:
    """True when an `authorization` header value is `Bearer <token>` (constant-time compare)."""
    return hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def security_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> SecurityConfig:
    """The SecurityConfig the flags (and TESSERA_INTERNAL_TOKEN) describe."""
    env = os.environ if environ is None else environ
    return from_args(SecurityConfig, args, token=args.internal_token or env.get(TOKEN_ENV, ""))


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
