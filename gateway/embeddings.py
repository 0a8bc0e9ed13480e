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


class EmbeddingRoutes:
    """The embeddings endpoint; the pooling config is read from the model's files once."""

    def __init__(self, serving: Serving, max_body_bytes: int, model: str) -> None:
        self.serving = serving
        self.max_body_bytes = max_body_bytes
        self.model = model

    @functools.cached_property
    def pooler(self) -> PoolerConfig:
        return read_pooler_config(resolve_model(self.model))

    async def embeddings(self, request: Request) -> Response:
        body = await read_json(request, self.max_body_bytes)
        req = parse(EmbeddingRequest, body, self.serving.limits)
        card = await self.serving.check_model(req.model)
        self.serving.check_runner(card, "pooling")
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        try:
            check_pooling_params(params, self.pooler, card.name)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "dimensions") from None
        prompts = [await self._encode(item, card) for item in req.inputs()]
        request_id = rs.new_id("embd")
        with self.serving.admit():
            vectors = await until_disconnect(request, self._run(request_id, prompts, params))
        response = _response(request_id, card.name, vectors, prompts, req.encoding_format)
        return JSONResponse(response)

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
        self, request_id: str, prompts: list[list[int]], params: PoolingParams
    ) -> list[bytes]:
        """Every input's vector, run concurrently; past the deadline: 408 (all aborted)."""
        timeout = self.serving.limits.timeout_s(None)
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
        request = EngineCoreRequest(request_id, ids, pooling_params=params)
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


def _response(
    request_id: str,
    model: str,
    vectors: list[bytes],
    prompts: list[list[int]],
    encoding: str | None,
) -> dict[str, Any]:
    num_tokens = sum(map(len, prompts))
    data = [
        {"object": "embedding", "index": i, "embedding": _encode_vector(v, encoding)}
        for i, v in enumerate(vectors)
    ]
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def _encode_vector(data: bytes, encoding: str | None) -> list[float] | str:
    """float: a JSON list; base64: the little-endian float32 bytes, as OpenAI sends them."""
    if encoding == "base64":
        return base64.b64encode(data).decode("ascii")
    values: list[float] = np.frombuffer(data, dtype="<f4").tolist()
    return values
