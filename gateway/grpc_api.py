"""The public gRPC text API (`tessera.v1.TextGeneration`), sharing the REST generate path.

Requests become the REST request models (gateway.grpc_mapping) and go through the same
checks, `gateway.prepare.Preparer` (options, tools, chat template, images), admission and
`Serving.generate` as REST; answers are built by REST's builders; the size limits (turns, content parts, stop
strings) are counted on the wire before protobuf parses a request (gateway.limits), images
on the proto before any is converted; `ApiError`s become gRPC statuses
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE...). A client
that cancels its call cancels the engine request; the call's deadline is the
request's `timeout` (the shorter of it and --request-timeout wins), past which
the request is aborted with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import numpy as np

from gateway import grpc_mapping as gm
from gateway import responses as rs
from gateway.admission import MessageBudgetInterceptor
from gateway.embeddings import MAX_INPUTS, Embedder
from gateway.errors import ApiError, InvalidRequest
from gateway.limits import capped_parser
from gateway.media import check_image_count
from gateway.prepare import Prepared, Preparer
from gateway.protocol import TokenizeRequest, parse
from gateway.serving import GenerateJob, Serving
from gateway.tracing import grpc_trace
from services.config import GatewayConfig, SecurityConfig
from services.grpc_utils import GrpcServer, Registration
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from services.types import PoolingParams

SERVICE_NAME = "tessera.v1.TextGeneration"


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    """TextGeneration over a `Serving`."""

    def __init__(self, serving: Serving, config: GatewayConfig | None = None) -> None:
        self.serving = serving
        self.embedder = Embedder(serving)
        self.prepare = Preparer(serving, config or GatewayConfig())

    async def Complete(self, request: pb.CompletionRequest, context: Any) -> pb.GenerateResponse:
        return await self._unary(self._completion_job(request), request.request_id, context)

    async def CompleteStream(
        self, request: pb.CompletionRequest, context: Any
    ) -> AsyncIterator[pb.GenerateChunk]:
        async for chunk in self._stream(self._completion_job(request), request.request_id, context):
            yield chunk

    async def Chat(self, request: pb.ChatRequest, context: Any) -> pb.GenerateResponse:
        return await self._unary(self._chat_job(request), request.request_id, context)

    async def ChatStream(
        self, request: pb.ChatRequest, context: Any
    ) -> AsyncIterator[pb.GenerateChunk]:
        async for chunk in self._stream(self._chat_job(request), request.request_id, context):
            yield chunk

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Any
    ) -> pb.ListModelsResponse:
        card = await _checked(self.serving.model_card(), context)
        model = pb.ModelCard(
            id=card.name, max_model_len=card.max_model_len, owned_by="tessera", created=card.created
        )
        adapters = self.serving.loras.model_entries({"id": card.name}) if self.serving.loras else []
        loras = [
            pb.ModelCard(
                id=a["id"],
                max_model_len=card.max_model_len,
                owned_by="tessera",
                created=card.created,
                parent=a["parent"],
            )
            for a in adapters
        ]
        return pb.ListModelsResponse(models=[model, *loras])

    async def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse:
        return await _checked(self._tokenize(request), context)

    async def Embed(self, request: pb.EmbedRequest, context: Any) -> pb.EmbedResponse:
        done = await _checked(self._embed(request, context.time_remaining()), context)
        return pb.EmbedResponse(
            id=request.request_id or done.request_id,
            model=done.model,
            embeddings=[
                pb.Embedding(values=np.frombuffer(v, "<f4").tolist()) for v in done.vectors
            ],
            usage=pb.Usage(prompt_tokens=done.num_tokens, total_tokens=done.num_tokens),
        )

    # -- helpers --------------------------------------------------------------------------

    async def _embed(self, request: pb.EmbedRequest, deadline_s: float | None) -> Any:
        inputs: list[str | list[int]] = [
            *request.texts,
            *(list(t.ids) for t in request.token_inputs),
        ]
        if not inputs or (request.texts and request.token_inputs):
            raise InvalidRequest("give texts or token_inputs, one of the two", "texts")
        if len(inputs) > MAX_INPUTS:
            raise InvalidRequest(f"at most {MAX_INPUTS} inputs", "texts")
        if any(len(item) == 0 for item in inputs) or any(
            i < 0 for t in request.token_inputs for i in t.ids
        ):
            raise InvalidRequest(
                "inputs must be non-empty texts or lists of token ids >= 0", "texts"
            )
        message: Any = request  # HasField takes the field names as literals in the stubs
        dimensions = request.dimensions if message.HasField("dimensions") else None
        if dimensions is not None and dimensions < 1:
            raise InvalidRequest("dimensions must be >= 1", "dimensions")
        normalize = request.normalize if message.HasField("normalize") else None
        params = PoolingParams(dimensions=dimensions, normalize=normalize)
        return await self.embedder.embed(request.model, inputs, params, deadline_s)

    async def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        card = await self.serving.check_model(request.model)
        tok = self.serving.tokenizer
        if request.messages:
            turns = parse(TokenizeRequest, {"messages": gm.messages_body(request.messages)})
            assert turns.messages is not None
            text = await tok.run(tok.render_chat, self.prepare.chat_turns(turns.messages))
        else:
            text = request.text
        ids = await tok.encode_async(text, request.add_special_tokens)
        return pb.TokenizeResponse(
            token_ids=ids,
            tokens=tok.token_strings(ids),
            count=len(ids),
            max_model_len=card.max_model_len,
        )

    async def _completion_job(self, request: pb.CompletionRequest) -> Prepared:
        req, options = gm.completion_request(request, self.serving.limits)
        return await self.prepare.completion(req.model, req.prompts, options, echo=False)

    async def _chat_job(self, request: pb.ChatRequest) -> Prepared:
        card = await self.serving.check_model(request.model)
        check_image_count(self.serving.images, card.name, gm.image_count(request.messages))
        return await self.prepare.chat(gm.chat_request(request, self.serving.limits))

    async def _unary(self, make_job: Any, given_id: str, context: Any) -> pb.GenerateResponse:
        with grpc_trace(context):
            return await self._unary_call(make_job, given_id, context)

    async def _unary_call(self, make_job: Any, given_id: str, context: Any) -> pb.GenerateResponse:
        prepared: Prepared = await _checked(make_job, context)
        job = prepared.job
        _honour_deadline(job, context)
        collector = rs.Collector(job)
        try:
            with self.serving.admit():
                async for delta in self.serving.generate(job):
                    collector.add(delta)
        except ApiError as exc:
            job.release()  # admission refused: the stream never ran
            await context.abort(exc.grpc_code, exc.message)
        tok = self.serving.tokenizer
        choices = [gm.choice(prepared, c, tok) for c in collector.ordered()]
        return pb.GenerateResponse(
            id=given_id or job.request_id, model=prepared.model, text=choices[0].text,
            finish_reason=choices[0].finish_reason, usage=gm.usage(collector), choices=choices,
        )  # fmt: skip

    async def _stream(
        self, make_job: Any, given_id: str, context: Any
    ) -> AsyncIterator[pb.GenerateChunk]:
        with grpc_trace(context):
            async for chunk in self._stream_call(make_job, given_id, context):
                yield chunk

    async def _stream_call(
        self, make_job: Any, given_id: str, context: Any
    ) -> AsyncIterator[pb.GenerateChunk]:
        prepared: Prepared = await _checked(make_job, context)
        job = prepared.job
        _honour_deadline(job, context)
        collector = rs.Collector(job)
        chunks = gm.Chunks(prepared, given_id or job.request_id, self.serving.tokenizer)
        try:
            with self.serving.admit():
                async for delta in self.serving.generate(job):
                    collector.add(delta)
                    for chunk in chunks.build(delta, collector):
                        yield chunk
        except ApiError as exc:
            job.release()  # admission refused: the stream never ran
            await context.abort(exc.grpc_code, exc.message)


def _honour_deadline(job: GenerateJob, context: Any) -> None:
    """Give `job` the call's deadline (grpc-timeout) as its timeout, when the call has one."""
    remaining = context.time_remaining()
    if remaining is not None:
        job.options = replace(job.options, timeout_s=max(remaining, 1e-3))


async def _checked(awaitable: Any, context: Any) -> Any:
    """Await `awaitable`; an ApiError aborts the call with its gRPC status."""
    try:
        return await awaitable
    except ApiError as exc:
        await context.abort(exc.grpc_code, exc.message)


def add_servicer(servicer: TextGenerationServicer, server: Any) -> None:
    """Put `servicer` on `server` like pb_grpc.add_TextGenerationServicer_to_server, each
    request parsed by gateway.limits.capped_parser (limits counted on the wire first)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["TextGeneration"].methods:
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=capped_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def build_grpc_server(
    address: str,
    serving: Serving,
    api_key: str = "",
    max_receive_bytes: int = 32 << 20,
    config: GatewayConfig | None = None,
) -> GrpcServer:
    """A GrpcServer (health + reflection) carrying the TextGeneration service; with `api_key`
    every call but health and reflection needs `authorization: Bearer <api_key>`. `config`
    gives the chat options (--tool-call-parser, --reasoning-parser)."""
    servicer = TextGenerationServicer(serving, config)
    registration = Registration(SERVICE_NAME, add_servicer, servicer)
    return GrpcServer(
        address,
        [registration],
        security=SecurityConfig(token=api_key),
        max_receive_bytes=max_receive_bytes,
        interceptors=[MessageBudgetInterceptor(serving.byte_budget)],
    )
