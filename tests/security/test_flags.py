"""Secrets reach the services by environment, read at start-up, never through argv."""

from __future__ import annotations

import pytest

from gateway.__main__ import config_from_args
from gateway.__main__ import parse_args as gateway_args
from scheduler_service.__main__ import parse_args as scheduler_args
from services.config import SecurityConfig
from services.security import API_KEY_ENV, TOKEN_ENV, security_from_args
from tessera.cli import build_services, internal_token


def test_internal_token_from_flag_or_environment() -> None:
    args = scheduler_args(["--worker", "h:1"])
    assert security_from_args(args, {}) == SecurityConfig()
    assert security_from_args(args, {TOKEN_ENV: "env-token"}).token == "env-token"
    flagged = scheduler_args(["--worker", "h:1", "--internal-token", "flag", "--tls-ca", "ca.pem"])
    assert security_from_args(flagged, {TOKEN_ENV: "env"}) == SecurityConfig(
        "flag", tls_ca="ca.pem"
    )


def test_gateway_api_key_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert config_from_args(gateway_args([])).api_key == "from-env"
    assert config_from_args(gateway_args(["--api-key", "flag"])).api_key == "flag"


def test_tessera_serve_passes_secrets_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from tessera.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--api-key", "client-key"])
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token = internal_token()
    assert len(token) >= 32 and token != internal_token()  # fresh and random by default
    monkeypatch.setenv(TOKEN_ENV, "given")
    assert internal_token() == "given"
    services = build_services(args, token)
    for service in services:
        assert service.env[TOKEN_ENV] == token
        assert token not in " ".join(service.argv) and "client-key" not in " ".join(service.argv)
    assert services[-1].env[API_KEY_ENV] == "client-key"
