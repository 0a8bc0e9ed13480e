"""A live gateway (uvicorn + gRPC text API) backed by the fake EngineCore, in a background thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
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
    engine_server: GrpcServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    def stop(self) -> None:
        self.gateway.request_stop()
        self.thread.join(10)


def start_stack(tokenizer: Tokenizer, **config: Any) -> Stack:
    """Start a fake engine and a gateway with `config` overrides; returns once both serve."""
    engine = FakeEngine(tokenizer.encode(ANSWER, add_special_tokens=False))
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}

    async def main() -> None:
        server = await start_fake_engine(engine)
        base = GatewayConfig(
            scheduler_address=f"127.0.0.1:{server.port}", port=0, grpc_port=free_port()
        )
        gateway = GatewayServer(replace(base, **config), tokenizer)
        ready.update(server=server, gateway=gateway)
        try:
            await gateway.serve()
        finally:
            await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (ready.get("gateway") and ready["gateway"].started):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    return Stack(engine, ready["gateway"], ready["server"], loop, thread)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Any) -> Tokenizer:
    return Tokenizer.load(default_model_dir)


@pytest.fixture(scope="session")
def stack(tokenizer: Tokenizer) -> Iterator[Stack]:
    """A gateway that requires API_KEY."""
    s = start_stack(tokenizer, api_key=API_KEY, max_body_bytes=64 * 1024)
    yield s
    s.stop()


@pytest.fixture
def engine(stack: Stack) -> Iterator[FakeEngine]:
    stack.engine.reset()
    yield stack.engine
    stack.engine.reset()
