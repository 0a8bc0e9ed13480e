"""Where the gateway sends a request among engine replicas, and how it finds them.

Pure pieces of the router (gateway/router.py): the prefix-affinity key of a
prompt (the chained hash of its first full KV blocks, computed by the same
function as the scheduler's prefix cache), rendezvous hashing bounded by load,
and DNS discovery of replicas (one address per replica, as compose `--scale`
and a Kubernetes headless Service answer).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from services.config import ROUTINGS
from services.prefix_hash import extend_block_hashes, lora_key
from services.types import EngineCoreRequest


@dataclass(frozen=True)
class RoutingPolicy:
    """How prefix affinity yields to load."""

    # "affinity" (rendezvous on the prompt's prefix hash, bounded by load) or "round-robin".
    mode: str = "affinity"
    # The affinity key is the hash of the prompt's first min(full blocks, this) blocks.
    prefix_blocks: int = 4
    # The affinity choice stands while its load <= ceil(min load * (1 + load_factor)) + slack.
    load_slack: int = 4
    load_factor: float = 0.25
    # A replica whose KV pool is fuller than this is passed over for the least-loaded one.
    kv_usage_high: float = 0.9
    # A new prefix skips its rendezvous winner when that replica already holds more than
    # this many prefixes over the replica holding fewest (spreads prefixes, hence cache, evenly).
    prefix_slack: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, not {self.mode!r}")
        if self.prefix_blocks < 1 or self.load_slack < 0 or self.load_factor < 0:
            raise ValueError("prefix_blocks must be >= 1; load_slack and load_factor >= 0")


@dataclass(frozen=True)
class Candidate:
    """One routable replica as the policy sees it."""

    address: str
    load: int  # waiting + running requests
    kv_usage: float  # used / total KV blocks, 0..1
    prefixes: int = 0  # affinity keys recently routed to it


def affinity_key(request: EngineCoreRequest, block_size: int, prefix_blocks: int) -> bytes | None:
    """The chained hash of the prompt's first full blocks (at most `prefix_blocks`), exactly as
    the scheduler hashes them; None when the prompt is shorter than one block."""
    if block_size <= 0:
        return None
    hashes = extend_block_hashes(
        [],
        request.prompt_token_ids,
        block_size,
        request.mm_inputs,
        request.cache_salt,
        lora_key(request.lora_request),  # an adapter's KV lives only where it ran
        max_blocks=prefix_blocks,
    )
    return hashes[-1] if hashes else None


def rendezvous_weight(key: bytes, address: str) -> int:
    """Highest-random-weight score of `address` for `key`: stable across gateways."""
    return int.from_bytes(hashlib.sha256(key + address.encode()).digest()[:8], "big")


def choose(
    candidates: Sequence[Candidate],
    key: bytes | None,
    policy: RoutingPolicy,
    turn: int,
    home: int | None = None,
) -> int:
    """Index of the replica for a request. With a key: `home` (where the key went before),
    else the rendezvous winner unless it holds over `prefix_slack` more prefixes than the
    emptiest; that choice stands unless it is over the load bound or its KV pool is nearly
    full. Otherwise, and without a key, the least loaded (ties go to the best rendezvous
    weight, or rotate by `turn` when there is no key)."""
    if not candidates:
        raise ValueError("no replica to choose from")
    n = len(candidates)
    if key is None:
        order = [(turn + i) % n for i in range(n)]
    else:
        order = sorted(range(n), key=lambda i: -rendezvous_weight(key, candidates[i].address))
        preferred = home if home is not None else _spread(candidates, order, policy)
        best = candidates[preferred]
        min_load = min(c.load for c in candidates)
        bound = math.ceil(min_load * (1 + policy.load_factor)) + policy.load_slack
        if best.load <= bound and best.kv_usage < policy.kv_usage_high:
            return preferred
    return min(order, key=lambda i: (candidates[i].kv_usage >= policy.kv_usage_high,
                                     candidates[i].load))  # fmt: skip


def _spread(candidates: Sequence[Candidate], order: list[int], policy: RoutingPolicy) -> int:
    """The replica for a new prefix: the first in rendezvous `order` within `prefix_slack`
    prefixes of the emptiest replica."""
    fewest = min(c.prefixes for c in candidates)
    return next(i for i in order if candidates[i].prefixes <= fewest + policy.prefix_slack)


def split_target(target: str) -> tuple[str, int]:
    """('engine', 50051) from 'engine:50051'; IPv6 literals as '[::1]:50051'."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"a scheduler address is host:port, not {target!r}")
    return host.strip("[]"), int(port)


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def join_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_replicas(target: str) -> list[str]:
    """One address per replica behind a DNS name (blocking): the name itself when it answers
    with one address (gRPC then resolves it as before), else 'ip:port' per address (IPv4
    preferred when both families answer). Raises OSError when the name does not resolve."""
    host, port = split_target(target)
    if is_ip_literal(host):
        return [target]
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})
    addresses = v4 or v6
    if len(addresses) <= 1:
        return [target]
    return [join_target(a, port) for a in addresses]
