"""Run one gateway: the HTTP app under uvicorn plus the gRPC text API, with a SIGTERM drain.

`GatewayServer(config).serve()` runs until stopped. The first SIGTERM/SIGINT
starts a drain: new requests get 503 while in-flight ones may finish for up to
`drain_timeout_s`; then both servers stop. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from gateway.app import build_app
from gateway.errors import ApiError
from gateway.grpc_api import build_grpc_server
from gateway.lora import LoRARegistry
from gateway.media import ImageService
from gateway.metrics import GatewayMetrics
from gateway.router import EngineRouter
from gateway.routing import RoutingPolicy
from gateway.serving import Serving
from gateway.tokenizer import Tokenizer
from services.config import GatewayConfig
from services.default_model import resolve_model
from services.grpc_utils import GrpcServer

log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05


class _DrainingUvicorn(uvicorn.Server):
    """uvicorn whose first exit signal drains the gateway instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, gateway: GatewayServer) -> None:
        super().__init__(config)
        self.gateway = gateway

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.gateway.serving.draining:
            super().handle_exit(sig, frame)  # second signal: stop now
            return
        self.gateway.loop.call_soon_threadsafe(self.gateway.start_drain)


class GatewayServer:
    """One gateway process (or thread, in tests); build it inside the event loop that serves it."""

    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        model_dir = resolve_model(config.model, config.hub)
        self.tokenizer = tokenizer or Tokenizer.load(
            model_dir,
            chat_template=config.chat_template,
            content_format=config.chat_template_content_format,
        )
        self.engine = EngineRouter(config.scheduler_addresses, RoutingPolicy(config.routing))
        self.serving = Serving(
            self.engine,
            self.tokenizer,
            GatewayMetrics(),
            config.served_model_name,
            config.max_queued_requests,
            config.max_inflight_bytes,
            config.limits,
            LoRARegistry(config.lora) if config.lora.enable_lora else None,
        )
        self.serving.images = ImageService.load(config, model_dir)
        self.serving.model_files = str(model_dir)
        self.app = build_app(config, self.serving)
        self.grpc: GrpcServer | None = None
        self.http: _DrainingUvicorn | None = None
        self.loop = asyncio.get_running_loop()
        self.grpc_port = 0  # the bound port, once serving
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        """Serve until stopped (signal, `request_stop()` or the drain ending)."""
        await self._describe_model()
        if self.config.grpc_port:  # 0 disables the text API
            self.grpc = build_grpc_server(
                f"{self.config.host}:{self.config.grpc_port}",
                self.serving,
                self.config.api_key,
                self.config.max_body_bytes,
                self.config,
            )
            self.grpc_port = self.grpc.port
            await self.grpc.start()
            await self.grpc.set_serving(True)
        uv_config = uvicorn.Config(
            self.app, host=self.config.host, port=self.config.port, log_config=None,
            access_log=False, lifespan="off", timeout_graceful_shutdown=1,
        )  # fmt: skip
        self.http = _DrainingUvicorn(uv_config, self)
        try:
            await self.http.serve()
        finally:
            await self._shutdown()

    @property
    def http_port(self) -> int:
        """The bound HTTP port once started (0 before)."""
        if self.http is None or not self.http.servers:
            return 0
        return int(self.http.servers[0].sockets[0].getsockname()[1])

    @property
    def started(self) -> bool:
        return self.http is not None and self.http.started

    def start_drain(self) -> None:
        """Refuse new requests (503) and stop once in-flight ones finished or time ran out."""
        if self._drain_task is None:
            self.serving.draining = True
            log.info("draining: %d requests in flight", self.serving.in_flight)
            self._drain_task = asyncio.ensure_future(self._drain())

    def request_stop(self) -> None:
        """Stop now (thread-safe)."""
        if self.http is not None:
            self.loop.call_soon_threadsafe(setattr, self.http, "should_exit", True)

    async def _drain(self) -> None:
        if self.grpc is not None:
            await self.grpc.set_serving(False)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.serving.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.http is not None:
            self.http.should_exit = True

    async def _describe_model(self) -> None:
        try:
            card = await self.serving.model_card()
            log.info("serving %s (max_model_len %d)", card.name, card.max_model_len)
        except ApiError as exc:
            log.warning("the scheduler is not reachable yet (%s); /health reports 503", exc.message)

    async def _shutdown(self) -> None:
        if self.grpc is not None:
            await self.grpc.stop(grace_s=1.0)
        await self.engine.close()
