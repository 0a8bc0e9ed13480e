"""POST /v1/embeddings in OpenAI's shape, for a server started with --runner pooling.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists;
each input is one prefill-only engine request (run concurrently, batched by the
scheduler). `encoding_format` "base64" sends the engine's little-endian float32 bytes
as they are; `dimensions` only where the model is Matryoshka (else 400, vLLM's wording).
Bad input is refused with OpenAI's 400 before any engine work: an empty list, an empty
string or token list, an input longer than the context, a generate-runner server.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import responses as rs
from gateway.errors import EngineError, InvalidRequest, RequestTimeout
from gateway.http_io import read_json, until_disconnect
from gateway.protocol import INT32_MAX, parse
from gateway.serving import ModelCard, Serving
from gateway.strict import Strict
from gateway.tracing import current_trace, span
from services.default_model import resolve_model
from services.pooling import PoolerConfig, check_pooling_params, read_pooler_config
from services.types import EngineCoreOutput, EngineCoreRequest, FinishReason, PoolingParams

MAX_INPUTS = 2048  # inputs per request, as OpenAI allows
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Input = str | list[str] | list[TokenId] | list[list[TokenId]]


class EmbeddingRequest(Strict):
    """The body of POST /v1/embeddings (OpenAI's fields; `normalize` is vLLM's)."""

    input: Input
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None  # informational: accepted, unused
    normalize: bool | None = None  # vLLM's extension: override the model's normalization

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Input) -> Input:
        items = [value] if isinstance(value, str) else value
        if not items:
            raise ValueError("must not be an empty list")
        if len(items) > MAX_INPUTS and not isinstance(items[0], int):
            raise ValueError(f"must hold at most {MAX_INPUTS} inputs")
        for item in items:
            if isinstance(item, str | list) and len(item) == 0:
                raise ValueError("must not contain an empty string or an empty token list")
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a text or a token-id list."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [list(value)]
        return list(value)


@dataclass
class Embedded:
    """What one embeddings request produced, input by input."""

    request_id: str
    model: str
    vectors: list[bytes]  # little-endian float32 each
    prompts: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.prompts))


class Embedder:
    """The embeddings path shared by REST and gRPC; the pooling config is read from the
    model's files (`serving.model_files`) once, when first needed."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    @functools.cached_property
    def pooler(self) -> PoolerConfig:
        return read_pooler_config(resolve_model(self.serving.model_files))

    async def embed(
        self,
        model: str | None,
        inputs: list[str | list[int]],
        params: PoolingParams,
        timeout_s: float | None = None,
    ) -> Embedded:
        """Every input's vector; ApiError (400 / 404 / 408 / 429 / 503) otherwise."""
        card = await self.serving.check_model(model)
        self.serving.check_runner(card, "pooling")
        try:
            check_pooling_params(params, self.pooler, card.name)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "dimensions") from None
        with span("tokenize"):
            prompts = [await self._encode(item, card) for item in inputs]
        request_id = rs.new_id("embd")
        if (trace := current_trace()) is not None:
            trace.describe_embedding(request_id, card.name, sum(map(len, prompts)))
        with self.serving.admit():
            vectors = await self._run(request_id, prompts, params, timeout_s)
        return Embedded(request_id, card.name, vectors, prompts)

    async def _encode(self, item: str | list[int], card: ModelCard) -> list[int]:
        ids = await self.serving.encode_prompt(item, card.vocab_size)
        if len(ids) > card.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {card.max_model_len} tokens. However, "
                f"you requested {len(ids)} tokens in the input for embedding generation. "
                "Please reduce the length of the input.",
                "input",
            )
        if not ids:
            raise InvalidRequest("an input has no tokens", "input")
        return ids

    async def _run(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: PoolingParams,
        timeout_s: float | None,
    ) -> list[bytes]:
        """Every input's vector, run concurrently; past the deadline: 408 (all aborted)."""
        timeout = self.serving.limits.timeout_s(timeout_s)
        try:
            async with asyncio.timeout(timeout), asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._one(f"{request_id}-{i}", ids, params))
                    for i, ids in enumerate(prompts)
                ]
        except* TimeoutError:
            self.serving.metrics.timeouts.inc()
            raise RequestTimeout(
                f"the request ran past its deadline of {timeout:g} s and was aborted"
            ) from None
        except* Exception as group_error:
            raise group_error.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _one(self, request_id: str, ids: list[int], params: PoolingParams) -> bytes:
        trace = current_trace()
        headers = trace.headers if trace is not None else {}
        request = EngineCoreRequest(request_id, ids, pooling_params=params, trace_headers=headers)
        last: EngineCoreOutput | None = None
        async with self.serving.engine.generate(request) as stream:
            async for out in stream:
                last = out
                if out.finished:
                    break
        if last is None or last.finish_reason != FinishReason.STOP or not last.pooling_output:
            detail = (last.error if last else "") or "the engine returned no vector"
            raise EngineError(detail)
        return last.pooling_output


class EmbeddingRoutes:
    """POST /v1/embeddings."""

    def __init__(self, serving: Serving, max_body_bytes: int) -> None:
        self.embedder = Embedder(serving)
        self.max_body_bytes = max_body_bytes

    async def embeddings(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        req = parse(EmbeddingRequest, body, self.embedder.serving.limits)
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        work = self.embedder.embed(req.model, req.inputs(), params)
        done = await until_disconnect(request, work)
        return JSONResponse(_response(done, req.encoding_format))


def _response(done: Embedded, encoding: str | None) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": _encode_vector(v, encoding)}
        for i, v in enumerate(done.vectors)
    ]
    return {
        "id": done.request_id,
        "object": "list",
        "created": int(time.time()),
        "data": data,
        "model": done.model,
        "usage": {"prompt_tokens": done.num_tokens, "total_tokens": done.num_tokens},
    }


def _encode_vector(data: bytes, encoding: str | None) -> list[float] | str:
    """float: a JSON list; base64: the little-endian float32 bytes, as OpenAI sends them."""
    if encoding == "base64":
        return base64.b64encode(data).decode("ascii")
    values: list[float] = np.frombuffer(data, dtype="<f4").tolist()
    return values
