"""A validated chat or completions request -> the `GenerateJob` to run, for REST and gRPC alike.

Both front ends parse their request into the same pydantic models (gateway.protocol) and
call `Preparer` here: the options (gateway.options.TextOptions, with the constraint that
forces tool calls), the tool plan, the reasoning parser, the model check, images and the
chat template. The REST routes and the gRPC servicer then only differ in how they read the
request and write the answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gateway import responses as rs
from gateway import tool_parsers, tools
from gateway.errors import InvalidRequest
from gateway.media import prepare_chat_images
from gateway.options import TextOptions
from gateway.protocol import ChatCompletionRequest, ChatMessage
from gateway.reasoning import ReasoningParser
from gateway.serving import GenerateJob, ModelCard, Serving
from gateway.tools import ToolPlan
from gateway.tracing import span
from services.config import GatewayConfig


@dataclass
class Prepared:
    """One request ready to run: its job, the model that answers and how to read the output."""

    job: GenerateJob
    model: str  # the card's name (a LoRA adapter's name when it names one)
    plan: ToolPlan | None = None  # chat with tools: how calls are parsed
    reasoning: ReasoningParser | None = None  # --reasoning-parser: the thinking split off
    chat: bool = False


class Preparer:
    """Builds the jobs of one gateway's generate requests."""

    def __init__(self, serving: Serving, config: GatewayConfig) -> None:
        self.serving = serving
        self.reasoning_parser = config.reasoning_parser  # "" or one of REASONING_PARSERS
        self.tool_parser = config.tool_call_parser
        if self.tool_parser == "auto":
            self.tool_parser = tool_parsers.detect(serving.tokenizer.hf)

    async def chat(self, req: ChatCompletionRequest) -> Prepared:
        """The job of a chat request: options, tool plan, images, the templated prompt."""
        options = tools.chat_options(req)
        plan = tools.plan_for(req, self.tool_parser)
        if plan is not None and self.tool_parser == "mistral":  # [TOOL_CALLS] is special
            options = dataclasses.replace(options, skip_special_tokens=False)
        card = await self._card(req.model)
        job = GenerateJob(rs.new_id("chatcmpl"), [], options, lora_request=card.lora_request)
        with span("tokenize"):
            if req.has_images:
                job.images = await prepare_chat_images(
                    self.serving.images,
                    card.name,
                    req.messages,
                    self.chat_turns(req.messages, req),
                    self.serving.tokenizer,
                    card.host_id,
                    req.chat_template_kwargs,
                )
            job.prompts.append(job.images.token_ids if job.images else await self._encode_chat(req))
        return Prepared(job, card.name, plan, self._reasoning(req), chat=True)

    async def completion(
        self, model: str | None, prompts: list[str | list[int]], options: TextOptions, echo: bool
    ) -> Prepared:
        """The job of a completions request (`echo` with logprobs asks for prompt logprobs)."""
        card = await self._card(model)
        with span("tokenize"):
            ids = [await self.serving.encode_prompt(p, card.vocab_size) for p in prompts]
        job = GenerateJob(
            rs.new_id("cmpl"),
            ids,
            options,
            prompt_logprobs=echo and options.logprobs is not None,
            lora_request=card.lora_request,
        )
        return Prepared(job, card.name)

    def chat_turns(
        self, messages: list[ChatMessage], req: ChatCompletionRequest | None = None
    ) -> list[dict[str, Any]]:
        """The turns handed to the chat template (with the offered tools when not native)."""
        offered = req.tools if req is not None and req.effective_tool_choice != "none" else None
        native = tools.template_takes_tools(self.serving.tokenizer.hf)
        return tools.chat_turns(messages, offered, native)

    async def _card(self, model: str | None) -> ModelCard:
        card = await self.serving.check_model(model)
        self.serving.check_runner(card, "generate")
        return card

    async def _encode_chat(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.serving.tokenizer
        offered = req.tools if req.effective_tool_choice != "none" else None
        native = tools.template_takes_tools(tok.hf)
        template_tools = tools.template_tools(offered) if native and offered else None
        try:
            return await tok.encode_chat_async(
                self.chat_turns(req.messages, req),
                tools=template_tools,
                template_kwargs=req.chat_template_kwargs,
            )
        except Exception as exc:  # jinja errors from the template (e.g. unsupported roles)
            raise InvalidRequest(f"cannot apply the chat template: {exc}", "messages") from None

    def _reasoning(self, req: ChatCompletionRequest) -> ReasoningParser | None:
        if not self.reasoning_parser:
            return None
        return ReasoningParser.for_request(self.reasoning_parser, req.chat_template_kwargs)
