"""The Starlette application: OpenAI routes, health, metrics, tokenize, version, OpenAPI.

`build_app(config, serving)` wires the routes, the error handlers (every
client error in OpenAI's shape, never a 500 for bad input), CORS and the
request-id / auth / access-log middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import metrics as gm
from gateway.admission import BodyBudgetMiddleware
from gateway.embeddings import EmbeddingRoutes
from gateway.errors import ApiError, MethodNotAllowed, NotFound, ServiceUnavailable, internal_error
from gateway.http_io import ClientDisconnected, read_json
from gateway.lora import LoRARoutes
from gateway.middleware import GatewayMiddleware
from gateway.openai_routes import OpenAIRoutes
from gateway.openapi import openapi_document
from gateway.protocol import DetokenizeRequest, TokenizeRequest, parse
from gateway.serving import Serving
from gateway.tools import chat_turns
from gateway.tracing import TracingMiddleware
from services import tracing
from services.config import GatewayConfig

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 1.0


def version() -> str:
    try:
        return importlib.metadata.version("tessera")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


class BasicRoutes:
    """Everything but the two generate endpoints."""

    def __init__(self, serving: Serving, max_body_bytes: int) -> None:
        self.serving = serving
        self.max_body_bytes = max_body_bytes

    async def models(self, request: Request) -> Response:
        card = await self.serving.model_card()
        model = {
            "id": card.name,
            "object": "model",
            "created": card.created,
            "owned_by": "tessera",
            "root": card.name,
            "parent": None,
            "max_model_len": card.max_model_len,
        }
        loras = self.serving.loras.model_entries(model) if self.serving.loras else []
        return JSONResponse({"object": "list", "data": [model, *loras]})

    async def base_name(self) -> str:
        return (await self.serving.model_card()).name

    async def health(self, request: Request) -> Response:
        if self.serving.draining:
            raise ServiceUnavailable("the server is shutting down")
        if not await self.serving.engine.healthy():
            raise ServiceUnavailable("the engine is not serving")
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        with contextlib.suppress(ApiError, TimeoutError):  # the vllm:* series need the model
            await asyncio.wait_for(self.serving.model_card(), STATS_TIMEOUT_S)
        try:
            replicas = await asyncio.wait_for(self.serving.engine.replica_stats(), STATS_TIMEOUT_S)
        except TimeoutError:
            replicas = []
        self.serving.metrics.set_replica_stats(replicas)
        return Response(self.serving.metrics.render(), media_type=gm.CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        req = parse(TokenizeRequest, await read_json(request, self.max_body_bytes))
        card = await self.serving.check_model(req.model)
        tok = self.serving.tokenizer
        add_special = req.add_special_tokens
        if req.messages is not None:
            text = await tok.run(tok.render_chat, chat_turns(req.messages, None, False))
            ids = await tok.encode_async(text, bool(add_special))
        else:
            ids = await tok.encode_async(req.prompt or "", add_special is not False)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": card.max_model_len,
                "tokens": ids,
                "token_strs": tok.token_strings(ids),
            }
        )

    async def detokenize(self, request: Request) -> Response:
        req = parse(DetokenizeRequest, await read_json(request, self.max_body_bytes))
        card = await self.serving.check_model(req.model)
        bad = [t for t in req.tokens if t >= card.vocab_size]
        if bad:
            raise ApiError(
                f"token id {bad[0]} is outside the vocabulary (size {card.vocab_size})", "tokens"
            )
        text = await self.serving.tokenizer.decode_async(req.tokens, False)
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": version()})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document(version()))


def build_app(config: GatewayConfig, serving: Serving) -> Starlette:
    """The ASGI app of one gateway."""
    basic = BasicRoutes(serving, config.max_body_bytes)
    openai = OpenAIRoutes(serving, config)
    embeddings = EmbeddingRoutes(serving, config.max_body_bytes)
    routes = [
        Route("/v1/chat/completions", openai.chat, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
        Route("/v1/models", basic.models, methods=["GET"]),
        Route("/health", basic.health, methods=["GET"]),
        Route("/metrics", basic.metrics, methods=["GET"]),
        Route("/tokenize", basic.tokenize, methods=["POST"]),
        Route("/detokenize", basic.detokenize, methods=["POST"]),
        Route("/version", basic.version, methods=["GET"]),
        Route("/openapi.json", basic.openapi, methods=["GET"]),
    ]
    if serving.loras is not None and config.lora.allow_runtime_lora_updating:
        lora = LoRARoutes(serving.loras, basic.base_name, config.max_body_bytes)
        routes += [
            Route("/v1/load_lora_adapter", lora.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", lora.unload, methods=["POST"]),
        ]
    middleware = [
        Middleware(
            GatewayMiddleware,
            metrics=serving.metrics,
            routes=[r.path for r in routes],
            api_key=config.api_key,
        ),
        Middleware(BodyBudgetMiddleware, budget=serving.byte_budget),
    ]
    if tracing.tracer() is not None:  # outside the access log, so its line has the trace id
        middleware.insert(0, Middleware(TracingMiddleware))
    if config.cors_allow_origins:  # outermost, so even a 401 carries the CORS headers
        middleware.insert(
            0,
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_allow_origins),
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["X-Request-Id"],
            ),
        )
    handlers: dict[Any, Any] = {
        ApiError: _api_error,
        HTTPException: _http_error,
        ClientDisconnected: _disconnected,
        Exception: _unexpected,
    }
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        error: ApiError = MethodNotAllowed(
            f"method {request.method} is not allowed on {request.url.path}"
        )
    elif exc.status_code == 404:
        error = NotFound(f"no route {request.url.path}")
    else:
        error = ApiError(str(exc.detail))
        error.status = exc.status_code
    return JSONResponse(error.body(), status_code=error.status, headers=exc.headers)


async def _disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it: the client is gone


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path, exc_info=exc)
    error = internal_error()
    return JSONResponse(error.body(), status_code=error.status)
