"""Exit 0 when a service is healthy: `python -m services.healthcheck grpc HOST:PORT` checks
grpc.health.v1, `python -m services.healthcheck http URL` expects HTTP 200 (compose uses both)."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from services.grpc_utils import check_health, health_status


def http_healthy(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def http_answers(url: str, timeout_s: float) -> bool:
    """The server at `url` answers at all, with any status (a gateway answers 503 while its
    scheduler is down)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("target", help="HOST:PORT for grpc, a URL for http")
    parser.add_argument("--service", default="", help="gRPC service name ('' = whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument(
        "--up",
        action="store_true",
        help="grpc: healthy when the server answers at all, NOT_SERVING included (a worker "
        "waiting for the scheduler's KV handshake)",
    )
    args = parser.parse_args(argv)
    if args.kind == "grpc" and args.up:
        ok = health_status(args.target, args.service, args.timeout) is not None
    elif args.kind == "grpc":
        ok = check_health(args.target, args.service, args.timeout)
    else:
        ok = http_healthy(args.target, args.timeout)
    print("healthy" if ok else "unhealthy")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
