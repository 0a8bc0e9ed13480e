"""The public gRPC text API (`tessera.v1.TextGeneration`), sharing the REST generate path.

Requests go through the same option checks (gateway.protocol), chat template,
admission and `Serving.generate` as REST; the size limits (turns, content parts, stop
strings) are counted on the wire before protobuf parses a request (gateway.limits), images
on the proto before any is converted; `ApiError`s become gRPC statuses
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE...). A client
that cancels its call cancels the engine request; the call's deadline is the
request's `timeout` (the shorter of it and --request-timeout wins), past which
the request is aborted with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import grpc
import numpy as np

from gateway import responses as rs
from gateway.admission import MessageBudgetInterceptor
from gateway.embeddings import MAX_INPUTS, Embedder
from gateway.errors import ApiError, InvalidRequest
from gateway.limits import capped_parser, check_stop
from gateway.media import check_image_count, prepare_chat_images
from gateway.options import TextOptions
from gateway.protocol import ROLES, ChatMessage, GrpcOptions, parse
from gateway.serving import GenerateJob, Serving
from gateway.tracing import grpc_trace, span
from services.config import SecurityConfig
from services.grpc_utils import GrpcServer, Registration
from services.pb import generate_pb2 as pb
from services.pb import generate_pb2_grpc as pb_grpc
from services.types import PoolingParams

SERVICE_NAME = "tessera.v1.TextGeneration"
_OPTIONAL = ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty")
_PLAIN = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens")


def options_dict(params: pb.TextSamplingParams) -> dict[str, Any]:
    """The sampling params as the JSON-like dict that gateway.protocol validates."""
    message: Any = params  # HasField takes the field names as literals in the stubs
    data: dict[str, Any] = {name: getattr(params, name) for name in _PLAIN}
    data.update({n: getattr(params, n) for n in _OPTIONAL if message.HasField(n)})
    data["stop"] = list(params.stop)
    data["include_stop_str_in_output"] = params.include_stop_str_in_output
    return data


def text_options(params: pb.TextSamplingParams, priority: int) -> TextOptions:
    """Validated options, with the same checks as the REST API."""
    try:
        check_stop(params.stop)  # the lengths: the wire count took the number
    except ValueError as exc:
        raise InvalidRequest(str(exc), "stop") from None
    checked = parse(GrpcOptions, options_dict(params))
    return replace(checked.text_options(checked.max_tokens, None), priority=priority)


def chat_messages(messages: Sequence[pb.ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidRequest("'messages' must not be empty", "messages")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequest(
                f"'messages[{i}].role' must be one of {', '.join(ROLES)}", "messages"
            )
    return [{"role": m.role, "content": _content(m)} for m in messages]


def _content(message: pb.ChatMessage) -> str | list[dict[str, Any]]:
    """The content as the REST path gives it to templates (gateway.protocol.ChatMessage.parts)."""
    if not message.parts:
        return str(message.content)
    return [
        {"type": "text", "text": p.text} if p.WhichOneof("part") == "text" else {"type": "image"}
        for p in message.parts
    ]


def image_messages(messages: Sequence[pb.ChatMessage]) -> list[ChatMessage] | None:
    """The turns as REST chat messages, images as data: URLs, so images take the REST path;
    None when no turn holds an image."""
    if not any(p.WhichOneof("part") == "image" for m in messages for p in m.parts):
        return None
    return [
        ChatMessage.model_validate(
            {"role": m.role, "content": [_part(p) for p in m.parts] if m.parts else m.content}
        )
        for m in messages
    ]


def _part(part: pb.ContentPart) -> dict[str, Any]:
    if part.WhichOneof("part") != "image":
        return {"type": "text", "text": part.text}
    mime = part.image.mime_type or "image/png"
    url = f"data:{mime};base64,{base64.b64encode(part.image.data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    """TextGeneration over a `Serving`."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.embedder = Embedder(serving)

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
            text = await tok.run(tok.render_chat, chat_messages(request.messages))
        else:
            text = request.text
        ids = await tok.encode_async(text, request.add_special_tokens)
        return pb.TokenizeResponse(
            token_ids=ids,
            tokens=tok.token_strings(ids),
            count=len(ids),
            max_model_len=card.max_model_len,
        )

    async def _completion_job(self, request: pb.CompletionRequest) -> tuple[GenerateJob, str]:
        card = await self.serving.check_model(request.model)
        options = text_options(request.params, request.priority)
        with span("tokenize"):
            prompt = await self.serving.tokenizer.encode_async(request.prompt)
        job = GenerateJob(rs.new_id("cmpl"), [prompt], options, lora_request=card.lora_request)
        return job, card.name

    async def _chat_job(self, request: pb.ChatRequest) -> tuple[GenerateJob, str]:
        card = await self.serving.check_model(request.model)
        options = text_options(request.params, request.priority)
        job = GenerateJob(rs.new_id("chatcmpl"), [], options, lora_request=card.lora_request)
        turns = chat_messages(request.messages)
        images = sum(p.WhichOneof("part") == "image" for m in request.messages for p in m.parts)
        check_image_count(self.serving.images, card.name, images)
        with_images = image_messages(request.messages)
        try:
            with span("tokenize"):
                if with_images is not None:
                    tok = self.serving.tokenizer
                    job.images = await prepare_chat_images(
                        self.serving.images, card.name, with_images, turns, tok, card.host_id
                    )
                job.prompts.append(
                    job.images.token_ids
                    if job.images
                    else await self.serving.tokenizer.encode_chat_async(turns)
                )
        except ApiError:
            raise
        except Exception as exc:
            raise InvalidRequest(f"cannot apply the chat template: {exc}", "messages") from None
        return job, card.name

    async def _unary(self, make_job: Any, given_id: str, context: Any) -> pb.GenerateResponse:
        with grpc_trace(context):
            return await self._unary_call(make_job, given_id, context)

    async def _unary_call(self, make_job: Any, given_id: str, context: Any) -> pb.GenerateResponse:
        job, model = await _checked(make_job, context)
        _honour_deadline(job, context)
        collector = rs.Collector(job)
        try:
            with self.serving.admit():
                async for delta in self.serving.generate(job):
                    collector.add(delta)
        except ApiError as exc:
            job.release()  # admission refused: the stream never ran
            await context.abort(exc.grpc_code, exc.message)
        choice = collector.ordered()[0]
        return pb.GenerateResponse(
            id=given_id or job.request_id, model=model, text=choice.text,
            finish_reason=choice.finish_reason or "", usage=_usage(collector),
        )  # fmt: skip

    async def _stream(
        self, make_job: Any, given_id: str, context: Any
    ) -> AsyncIterator[pb.GenerateChunk]:
        with grpc_trace(context):
            job, _ = await _checked(make_job, context)
            _honour_deadline(job, context)
            collector = rs.Collector(job)
            rid = given_id or job.request_id
            try:
                with self.serving.admit():
                    async for delta in self.serving.generate(job):
                        collector.add(delta)
                        if delta.text or delta.finish_reason:
                            usage = _usage(collector) if delta.finish_reason else None
                            yield pb.GenerateChunk(
                                id=rid,
                                text=delta.text,
                                finish_reason=delta.finish_reason or "",
                                usage=usage,
                            )
            except ApiError as exc:
                job.release()  # admission refused: the stream never ran
                await context.abort(exc.grpc_code, exc.message)


def _honour_deadline(job: GenerateJob, context: Any) -> None:
    """Give `job` the call's deadline (grpc-timeout) as its timeout, when the call has one."""
    remaining = context.time_remaining()
    if remaining is not None:
        job.options = replace(job.options, timeout_s=max(remaining, 1e-3))


def _usage(collector: rs.Collector) -> pb.Usage:
    u = collector.usage()
    return pb.Usage(
        prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
        total_tokens=u["total_tokens"], cached_tokens=u["prompt_tokens_details"]["cached_tokens"],
    )  # fmt: skip


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
    address: str, serving: Serving, api_key: str = "", max_receive_bytes: int = 32 << 20
) -> GrpcServer:
    """A GrpcServer (health + reflection) carrying the TextGeneration service; with `api_key`
    every call but health and reflection needs `authorization: Bearer <api_key>`."""
    registration = Registration(SERVICE_NAME, add_servicer, TextGenerationServicer(serving))
    return GrpcServer(
        address,
        [registration],
        security=SecurityConfig(token=api_key),
        max_receive_bytes=max_receive_bytes,
        interceptors=[MessageBudgetInterceptor(serving.byte_budget)],
    )
