"""Where tensor-parallel ranks meet: a private file for local ranks, an authenticated store
served by rank 0 for ranks started by hand on other hosts.

torch.distributed's own TCPStore is not used: its server listens on every interface
whatever host it is given, and anyone who reaches it can read, write and delete keys
without credentials (and race the rendezvous keys when a worker restarts).

- Local ranks (spawned by rank 0): a `FileStore` in a fresh 0700 directory, its path handed
  to the children on their command line; no socket at all. Gloo's (and NCCL's) sockets
  are held to the loopback interface (`hold_to_loopback`).
- Multi-host ranks: rank 0 serves the store over gRPC (`StoreServer`, service
  tessera.v1.Rendezvous) on the init method's HOST:PORT; every rank reaches it through
  `RemoteStore`, a torch.distributed.Store subclass. Calls without the internal token get
  UNAUTHENTICATED before anything is read or written, TLS is used where configured, and the
  store holds at most MAX_STORE_BYTES. Gloo's rendezvous only calls set, wait and get
  (measured on torch 2.13); the rest of the Store interface is there for NCCL.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import grpc
import psutil
import torch.distributed as dist

from services.config import SecurityConfig
from services.grpc_interceptors import carries_token
from services.grpc_utils import sync_channel
from services.pb import rendezvous_pb2 as pb
from services.pb import rendezvous_pb2_grpc as pb_grpc
from services.security import server_credentials

MAX_STORE_BYTES = 16 << 20  # keys + values; gloo stores ~170 bytes per rank and group
MAX_KEYS = 65536
MAX_MESSAGE_BYTES = 1 << 20
MAX_WAIT_MS = 5_000  # one Get call waits at most this long; the client calls again
LOOPBACK_SOCKET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


# ------------------------------------------------------------------- local ranks
def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 ("lo" on Linux)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return name
    raise OSError("no network interface holds 127.0.0.1")


def hold_to_loopback(environ: dict[str, str] | os._Environ[str]) -> None:
    """Make gloo and NCCL (read when a group forms) listen and connect on loopback only:
    by default gloo binds the address the host name resolves to, NCCL the first
    non-loopback interface."""
    name = loopback_interface()
    for var in LOOPBACK_SOCKET_VARS:
        environ[var] = name


# --------------------------------------------------------------- multi-host ranks
def store_address(init_method: str) -> str:
    """tcp://HOST:PORT -> the gRPC address HOST:PORT (ValueError for any other form)."""
    parts = urlsplit(init_method)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or not port or parts.path not in ("", "/"):
        raise ValueError(
            f"tensor parallel init method must be tcp://HOST:PORT, not {init_method!r}"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


def require_token(security: SecurityConfig) -> None:
    """Ranks on several hosts need the internal token: without it anyone who reaches the
    rendezvous could join the group."""
    if not security.token:
        raise ValueError(
            "tensor parallel ranks started by hand (multi-host) need the internal token on "
            "every rank (TESSERA_INTERNAL_TOKEN or --internal-token): it guards the rendezvous"
        )


class StoreFullError(Exception):
    """The store would exceed MAX_STORE_BYTES or MAX_KEYS."""


class KeyValueStore:
    """The store's state: bytes by key, bounded, with waits for keys to appear."""

    def __init__(self, max_bytes: int = MAX_STORE_BYTES, max_keys: int = MAX_KEYS) -> None:
        self.max_bytes, self.max_keys = max_bytes, max_keys
        self.data: dict[str, bytes] = {}
        self.size = 0
        self.changed = threading.Condition()

    def _put(self, key: str, value: bytes) -> None:  # with self.changed held
        old = self.data.get(key)
        size = self.size + len(value) + (len(key) if old is None else -len(old))
        if size > self.max_bytes or (old is None and len(self.data) >= self.max_keys):
            raise StoreFullError(f"the rendezvous store is full ({self.max_bytes} bytes)")
        self.data[key], self.size = value, size
        self.changed.notify_all()

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self._put(key, value)

    def get(self, keys: list[str], wait_s: float) -> list[bytes] | None:
        """The keys' values once all are present; None if they are not within wait_s."""
        with self.changed:
            if not self.changed.wait_for(lambda: all(k in self.data for k in keys), wait_s):
                return None
            return [self.data[k] for k in keys]

    def add(self, key: str, amount: int) -> int:
        with self.changed:
            value = int(self.data.get(key, b"0")) + amount
            self._put(key, str(value).encode())
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.changed:
            current = self.data.get(key)
            if current is None and expected:
                return expected
            if current is None or current == expected:
                self._put(key, desired)
                return desired
            return current

    def delete(self, key: str) -> bool:
        with self.changed:
            value = self.data.pop(key, None)
            if value is not None:
                self.size -= len(key) + len(value)
            return value is not None


class _Servicer(pb_grpc.RendezvousServicer):
    def __init__(self, store: KeyValueStore) -> None:
        self.store = store

    def Set(self, request: pb.SetRequest, context: Any) -> pb.SetResponse:
        _guard(context, lambda: self.store.set(request.key, request.value))
        return pb.SetResponse()

    def Get(self, request: pb.GetRequest, context: Any) -> pb.GetResponse:
        wait_s = min(max(request.wait_ms, 0), MAX_WAIT_MS) / 1000
        values = self.store.get(list(request.keys), wait_s)
        return pb.GetResponse(ready=values is not None, values=values or [])

    def Add(self, request: pb.AddRequest, context: Any) -> pb.AddResponse:
        return pb.AddResponse(
            value=_guard(context, lambda: self.store.add(request.key, request.amount))
        )

    def CompareSet(self, request: pb.CompareSetRequest, context: Any) -> pb.CompareSetResponse:
        r = request
        value = _guard(context, lambda: self.store.compare_set(r.key, r.expected, r.desired))
        return pb.CompareSetResponse(value=value)

    def DeleteKey(self, request: pb.DeleteKeyRequest, context: Any) -> pb.DeleteKeyResponse:
        return pb.DeleteKeyResponse(deleted=self.store.delete(request.key))

    def NumKeys(self, request: pb.NumKeysRequest, context: Any) -> pb.NumKeysResponse:
        return pb.NumKeysResponse(count=len(self.store.data))


def _guard(context: Any, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except StoreFullError as exc:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    except ValueError as exc:  # add on a key that does not hold an integer
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class _TokenCheck(grpc.ServerInterceptor):
    """Every call must carry `authorization: Bearer <token>`, checked before the request is
    read (services.grpc_interceptors does the same for the asyncio servers)."""

    def __init__(self, token: str) -> None:
        self.token = token

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")

        self.denied = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        return continuation(details) if carries_token(details, self.token) else self.denied


class StoreServer:
    """Rank 0's side of the multi-host rendezvous: a blocking gRPC server on `address`
    (HOST:PORT exactly, not every interface) that needs `security`'s token."""

    def __init__(self, address: str, security: SecurityConfig, world_size: int) -> None:
        require_token(security)
        self.store = KeyValueStore()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2 * world_size + 4),
            interceptors=[_TokenCheck(security.token)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=8 * world_size + 16,
        )
        pb_grpc.add_RendezvousServicer_to_server(_Servicer(self.store), self.server)
        if security.tls:
            port = self.server.add_secure_port(address, server_credentials(security))
        else:
            port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address} for the tensor parallel rendezvous")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=1.0).wait()


class RemoteStore(dist.Store):
    """A torch.distributed.Store backed by rank 0's StoreServer (token and TLS as
    `security` says); waits for the server to come up within the store's timeout."""

    def __init__(self, address: str, security: SecurityConfig, timeout: timedelta) -> None:
        require_token(security)
        super().__init__()
        self.set_timeout(timeout)
        self.channel = sync_channel(address, security=security)
        self.stub = pb_grpc.RendezvousStub(self.channel)

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self.wait_timeout = timeout

    def _call(self, method: Callable[..., Any], request: Any) -> Any:
        deadline = self.wait_timeout.total_seconds()
        try:
            return method(request, timeout=deadline, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise dist.DistStoreError(f"tensor parallel rendezvous: {exc.details()}") from None

    def set(self, key: str, value: bytes | str) -> None:
        self._call(self.stub.Set, pb.SetRequest(key=key, value=_bytes(value)))

    def get(self, key: str) -> bytes:
        return self._wait_values([key], self.wait_timeout)[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_values(keys, timeout or self.wait_timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(self.stub.Get, pb.GetRequest(keys=keys, wait_ms=0)).ready)

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self.stub.Add, pb.AddRequest(key=key, amount=amount)).value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        request = pb.CompareSetRequest(key=key, expected=_bytes(expected), desired=_bytes(desired))
        return bytes(self._call(self.stub.CompareSet, request).value)

    def delete_key(self, key: str) -> bool:
        return bool(self._call(self.stub.DeleteKey, pb.DeleteKeyRequest(key=key)).deleted)

    def num_keys(self) -> int:
        return int(self._call(self.stub.NumKeys, pb.NumKeysRequest()).count)

    def close(self) -> None:
        self.channel.close()

    def _wait_values(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left_ms = int(1000 * (deadline - time.monotonic()))
            wait_ms = max(0, min(left_ms, MAX_WAIT_MS))
            reply = self._call(self.stub.Get, pb.GetRequest(keys=keys, wait_ms=wait_ms))
            if reply.ready:
                return [bytes(v) for v in reply.values]
            if left_ms <= 0:
                raise dist.DistStoreError(
                    f"tensor parallel rendezvous: timed out waiting for {keys}"
                )


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
