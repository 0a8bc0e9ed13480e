"""POST /v1/chat/completions and POST /v1/completions, streaming (SSE) and not.

Both parse and validate the body, check the model, tokenize off the event
loop, take an admission slot, then wait for the first output while watching
for a disconnect, so errors before the first token get a proper status code.
A stream that fails later ends with an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import responses as rs
from gateway.chunks import ChatChunks, ChunkBuilder, CompletionChunks
from gateway.errors import ApiError, internal_error
from gateway.http_io import ClientDisconnected, read_json, until_disconnect
from gateway.output import ChoiceDelta
from gateway.prepare import Preparer
from gateway.protocol import ChatCompletionRequest, CompletionRequest, parse
from gateway.serving import GenerateJob, Serving
from gateway.tracing import span
from services.config import GatewayConfig

log = logging.getLogger(__name__)


class OpenAIRoutes:
    """The two generate endpoints of the OpenAI API."""

    def __init__(self, serving: Serving, config: GatewayConfig) -> None:
        self.serving = serving
        self.max_body_bytes = config.max_body_bytes
        self.prepare = Preparer(serving, config)

    async def chat(self, request: Request) -> Response:
        with span("parse"):
            body = await read_json(request, self.max_body_bytes)
            req = parse(ChatCompletionRequest, body, self.serving.limits)
        prepared = await self.prepare.chat(req)
        job, model, plan, thinking = prepared.job, prepared.model, prepared.plan, prepared.reasoning
        collector = rs.Collector(job)
        try:
            first, stream = await self._start(request, job)
        except BaseException:
            job.release()  # the stream never ran: free the images here
            raise
        with_logprobs = job.options.logprobs is not None
        tok = self.serving.tokenizer
        if not req.stream:
            await until_disconnect(request, self._collect(collector, first, stream))
            return JSONResponse(
                rs.chat_response(
                    job.request_id, model, collector, tok, with_logprobs, plan, thinking
                )
            )
        chunks = ChatChunks(
            job.request_id, model, tok, with_logprobs, job.options.n, plan, thinking
        )
        events = self._events(job, collector, _prepend(first, stream), chunks, req.include_usage)
        return EventSourceResponse(events, sep="\n", ping=600)

    async def completions(self, request: Request) -> Response:
        with span("parse"):
            body = await read_json(request, self.max_body_bytes)
            req = parse(CompletionRequest, body, self.serving.limits)
        prepared = await self.prepare.completion(
            req.model, req.prompts, req.options(), bool(req.echo)
        )
        job, model = prepared.job, prepared.model
        echo = await self._echo_texts(req, job) if req.echo else {}
        collector = rs.Collector(job)
        first, stream = await self._start(request, job)
        if not req.stream:
            await until_disconnect(request, self._collect(collector, first, stream))
            tok = self.serving.tokenizer
            return JSONResponse(rs.completion_response(job.request_id, model, collector, tok, echo))
        chunks = CompletionChunks(job, model, self.serving.tokenizer, echo)
        events = self._events(job, collector, _prepend(first, stream), chunks, req.include_usage)
        return EventSourceResponse(events, sep="\n", ping=600)

    # -- shared steps ----------------------------------------------------------------------

    async def _echo_texts(self, req: CompletionRequest, job: GenerateJob) -> dict[int, str]:
        texts = {}
        for i, prompt in job.choices():
            original = req.prompts[i // job.options.n]
            texts[i] = (
                original
                if isinstance(original, str)
                else await self.serving.tokenizer.decode_async(prompt)
            )
        return texts

    async def _start(
        self, request: Request, job: GenerateJob
    ) -> tuple[ChoiceDelta, AsyncGenerator[ChoiceDelta, None]]:
        """Admit the job and wait for its first delta (or a disconnect, or an error)."""
        self.serving.acquire()
        stream = self.serving.generate(job)
        try:
            first = await until_disconnect(request, anext(stream))
        except BaseException as exc:
            self.serving.release()
            await stream.aclose()
            if isinstance(exc, ClientDisconnected):
                self.serving.metrics.disconnects.inc()
            raise
        return first, stream

    async def _collect(
        self, collector: rs.Collector, first: ChoiceDelta, stream: AsyncGenerator[ChoiceDelta, None]
    ) -> None:
        try:
            collector.add(first)
            async for delta in stream:
                collector.add(delta)
        except asyncio.CancelledError:
            self.serving.metrics.disconnects.inc()
            raise
        finally:
            self.serving.release()
            await stream.aclose()

    async def _events(
        self,
        job: GenerateJob,
        collector: rs.Collector,
        stream: AsyncGenerator[ChoiceDelta, None],
        chunks: ChunkBuilder,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """The SSE data of a stream; ends with `[DONE]` (after an error event on failure)."""
        try:
            for chunk in chunks.opening():
                yield json.dumps(chunk)
            async for delta in stream:
                collector.add(delta)
                for built in chunks.build(delta):
                    yield json.dumps(built)
            if include_usage:
                yield json.dumps(chunks.usage(collector.usage()))
        except asyncio.CancelledError:
            self.serving.metrics.disconnects.inc()
            raise
        except ApiError as exc:
            yield json.dumps(exc.body())
        except Exception:
            log.exception("stream %s failed", job.request_id)
            yield json.dumps(internal_error().body())
        finally:
            self.serving.release()
            await stream.aclose()
        yield "[DONE]"


async def _prepend(
    first: ChoiceDelta, rest: AsyncGenerator[ChoiceDelta, None]
) -> AsyncGenerator[ChoiceDelta, None]:
    """`first`, then `rest`; closing this closes `rest` (cancelling its engine calls)."""
    try:
        yield first
        async for delta in rest:
            yield delta
    finally:
        await rest.aclose()
