"""The internal services (EngineCore, Worker) behind a shared token, and mutual TLS.

Real gRPC servers on loopback: the fake worker behind the real Worker service, the real
EngineCore service in front, the scheduler's client sending the process's internal token.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from scheduler_service.engine import EngineCore
from scheduler_service.service import EngineCoreServer
from scheduler_service.worker_client import GrpcWorkerClient
from services.config import CacheConfig, SchedulerConfig, SecurityConfig
from services.grpc_utils import (
    GrpcServer,
    Registration,
    aio_channel,
    check_health,
    internal_security,
    set_internal_security,
    sync_channel,
)
from services.pb import engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.engine_session import OneRequest, generate_sync
from tests.scheduler.fake_worker import FakeWorker
from worker_service.server import WorkerServicer, build_server

pytestmark = pytest.mark.timeout(60)
TOKEN = "internal-secret-token"
NONE, WRONG, RIGHT = SecurityConfig(), SecurityConfig(token="nope"), SecurityConfig(token=TOKEN)


@pytest.fixture
def internal_token() -> Iterator[SecurityConfig]:
    """This process's internal services and channels use TOKEN for the test's duration."""
    before = internal_security()
    set_internal_security(RIGHT)
    yield RIGHT
    set_internal_security(before)


class Internal:
    """A Worker service (fake worker) and an EngineCore service using it, on a loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._build())
        self.engine_address = f"127.0.0.1:{self.engine_server.port}"

    async def _build(self) -> None:  # gRPC servers are built inside the loop that serves them
        self.worker_server = await _start(build_server("127.0.0.1:0", FakeWorker()))
        self.worker_address = f"127.0.0.1:{self.worker_server.port}"
        client = GrpcWorkerClient(self.worker_address, step_timeout_s=10)
        engine = await asyncio.to_thread(EngineCore, SchedulerConfig(), CacheConfig(), [client])
        self.engine_server = EngineCoreServer("127.0.0.1:0", engine, [self.worker_address], 0.2)
        await self.engine_server.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.run(self.engine_server.stop(0.2))
        self.run(self.worker_server.stop(0.2))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def _start(server: GrpcServer) -> GrpcServer:
    await server.start()
    await server.set_serving(True)
    return server


@pytest.fixture
def internal(internal_token: SecurityConfig) -> Iterator[Internal]:
    stack = Internal()
    yield stack
    stack.close()


def _engine_info(address: str, security: SecurityConfig) -> grpc.StatusCode:
    with sync_channel(address, security=security) as channel:
        stub = engine_pb2_grpc.EngineCoreStub(channel)
        try:
            stub.GetServerInfo(engine_pb2.GetServerInfoRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _worker_info(address: str, security: SecurityConfig) -> grpc.StatusCode:
    with sync_channel(address, security=security) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("security", "expected"),
    [
        (NONE, grpc.StatusCode.UNAUTHENTICATED),
        (WRONG, grpc.StatusCode.UNAUTHENTICATED),
        (RIGHT, grpc.StatusCode.OK),
    ],
    ids=["no-token", "wrong-token", "right-token"],
)
def test_internal_services_need_the_token(
    internal: Internal, security: SecurityConfig, expected: grpc.StatusCode
) -> None:
    assert _engine_info(internal.engine_address, security) == expected
    assert _worker_info(internal.worker_address, security) == expected


def test_health_stays_open_and_generate_and_abort_need_the_token(internal: Internal) -> None:
    for address in (internal.engine_address, internal.worker_address):
        assert check_health(address, security=NONE)
    request = engine_pb2.EngineCoreRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
    request.sampling_params.max_tokens = 4
    with sync_channel(internal.engine_address, security=NONE) as channel:
        stub = engine_pb2_grpc.EngineCoreStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            generate_sync(stub, request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.Abort(engine_pb2.AbortRequest(request_ids=["r1"]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the scheduler's own channel to the worker carries the token: generation works end to end
    with sync_channel(internal.engine_address, security=RIGHT) as channel:
        outputs = generate_sync(engine_pb2_grpc.EngineCoreStub(channel), request, timeout=10)
    assert sum(len(o.new_token_ids) for o in outputs) == 4


# -- TLS --------------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _issue(tmp: Path, name: str, ca: Path, ca_key: Path) -> tuple[Path, Path]:
    """A key and certificate for 127.0.0.1/localhost, signed by the CA."""
    key, csr, cert, ext = (tmp / f"{name}{s}" for s in (".key", ".csr", ".pem", ".ext"))
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
             "-out", str(csr), "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SecurityConfig]:
    """A self-signed CA, a server and a client certificate made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    tmp = tmp_path_factory.mktemp("pki")
    ca, ca_key = tmp / "ca.pem", tmp / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key),
             "-out", str(ca), "-days", "2", "-subj", "/CN=tessera-test-ca")  # fmt: skip
    server_cert, server_key = _issue(tmp, "server", ca, ca_key)
    client_cert, client_key = _issue(tmp, "client", ca, ca_key)
    return {
        "server": SecurityConfig(TOKEN, str(server_cert), str(server_key), str(ca)),
        "client": SecurityConfig(TOKEN, str(client_cert), str(client_key), str(ca)),
        "no_client_cert": SecurityConfig(TOKEN, tls_ca=str(ca)),
    }


def test_mutual_tls_with_token(pki: dict[str, SecurityConfig]) -> None:
    servicer = WorkerServicer(FakeWorker())
    registration = Registration(
        "tessera.v1.Worker", worker_pb2_grpc.add_WorkerServicer_to_server, servicer
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def make() -> GrpcServer:  # built inside the loop that serves it
        return await _start(GrpcServer("127.0.0.1:0", [registration], security=pki["server"]))

    server = run(make())
    address = f"localhost:{server.port}"
    try:
        assert _worker_info(address, pki["client"]) == grpc.StatusCode.OK
        assert _worker_info(address, NONE) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert _worker_info(address, pki["no_client_cert"]) == grpc.StatusCode.UNAVAILABLE
        no_token = SecurityConfig("", *(getattr(pki["client"], f) for f in _TLS_FIELDS))
        assert _worker_info(address, no_token) == grpc.StatusCode.UNAUTHENTICATED
        assert check_health(address, security=no_token)
    finally:
        run(server.stop(0.2))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


_TLS_FIELDS = ("tls_cert", "tls_key", "tls_ca")


def test_asyncio_channels_send_the_token_on_every_kind_of_call(internal: Internal) -> None:
    request = engine_pb2.EngineCoreRequest(request_id="a1", prompt_token_ids=[1, 2, 3])
    request.sampling_params.max_tokens = 3

    async def generate(security: SecurityConfig) -> int | grpc.StatusCode:
        async with aio_channel(internal.engine_address, security=security) as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            try:
                await stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)  # unary-unary
                return sum([len(o.new_token_ids) async for o in OneRequest(stub, request)])
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    assert internal.run(generate(NONE)) == grpc.StatusCode.UNAUTHENTICATED
    assert internal.run(generate(RIGHT)) == 3
