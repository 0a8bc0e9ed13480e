"""A live gateway (uvicorn + gRPC text API) backed by the fake EngineCore, in a background thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from gateway.server import GatewayServer
from gateway.tokenizer import Tokenizer
from services.config import GatewayConfig
from services.grpc_utils import GrpcServer
from tests.conftest import free_port
from tests.gateway.fake_engine import FakeEngine, start_fake_engine

API_KEY = "test-key"
ANSWER = "Hello there! Café, naïve 😀 日本語. The END of it."


@dataclass
class Stack:
    """The fake engine and a gateway in front of it, served from one event loop thread."""

    engine: FakeEngine
    gateway: GatewayServer
    engine_server: GrpcServer  # the first replica's server
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    engine_servers: list[GrpcServer] = field(default_factory=list)  # one per engine replica

    def stop(self) -> None:
        self.gateway.request_stop()
        self.thread.join(10)


def start_stack(
    tokenizer: Tokenizer, replicas: int = 1, runner: str = "generate", **config: Any
) -> Stack:
    """Start a fake engine and a gateway with `config` overrides; returns once both serve.
    With `replicas` > 1 the one fake engine is served by that many gRPC servers, each an
    engine replica of the gateway (data parallel): `engine` records the requests of all."""
    engine = FakeEngine(tokenizer.encode(ANSWER, add_special_tokens=False), runner=runner)
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}

    async def main() -> None:
        servers = [await start_fake_engine(engine) for _ in range(replicas)]
        addresses = [f"127.0.0.1:{server.port}" for server in servers]
        base = GatewayConfig(
            scheduler_address=addresses[0],
            extra_scheduler_addresses=tuple(addresses[1:]),
            port=0,
            grpc_port=free_port(),
        )
        gateway = GatewayServer(replace(base, **config), tokenizer)
        ready.update(servers=servers, gateway=gateway)
        try:
            await gateway.serve()
        finally:
            for server in servers:
                await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (ready.get("gateway") and ready["gateway"].started):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    servers = ready["servers"]
    return Stack(engine, ready["gateway"], servers[0], loop, thread, servers)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Any) -> Tokenizer:
    return Tokenizer.load(default_model_dir)


@pytest.fixture(scope="session")
def stack(tokenizer: Tokenizer) -> Iterator[Stack]:
    """A gateway that requires API_KEY."""
    s = start_stack(tokenizer, api_key=API_KEY, max_body_bytes=64 * 1024)
    yield s
    s.stop()


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def stack_dp(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> Iterator[Stack]:
    """Like `stack`, once with one engine replica and once with two (data parallel); a
    module uses it in place of `stack` by defining `stack` as this fixture."""
    s = start_stack(tokenizer, request.param, api_key=API_KEY, max_body_bytes=64 * 1024)
    yield s
    s.stop()


@pytest.fixture
def engine(stack: Stack) -> Iterator[FakeEngine]:
    stack.engine.reset()
    yield stack.engine
    stack.engine.reset()
