"""`TextOptions`: the protocol-neutral sampling and stopping options of one request.

Shared by the REST API (built from the pydantic request models in gateway.protocol)
and the gRPC text API. `TextOptions.sampling_params` checks what only the model
knows (vocabulary, context length) and builds the engine's SamplingParams.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import ValidationInfo

from gateway.errors import InvalidRequest
from services.config import REASONING_PARSERS, TOOL_CALL_PARSERS, GatewayConfig, RequestLimits
from services.types import SamplingParams, StructuredOutputParams


@dataclass(frozen=True)
class TextOptions:
    """Sampling and stopping options in text terms (REST and gRPC)."""

    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    prompt_logprobs: int | None = None  # top logprobs per prompt token (vLLM's field)
    priority: int = 0
    structured_output: StructuredOutputParams | None = None  # a checked decoding constraint
    timeout_s: float | None = None  # the client's deadline in seconds; None: the server's

    def sampling_params(
        self, prompt_len: int, max_model_len: int, vocab_size: int, prompt_logprobs: bool = False
    ) -> SamplingParams:
        """SamplingParams for one engine request; 400 when the request cannot fit."""
        self._check_ids(vocab_size)
        max_tokens = self._max_tokens(prompt_len, max_model_len)
        if self.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens"
            )
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            logprobs=self.logprobs,
            prompt_logprobs=_most(self.logprobs if prompt_logprobs else None, self.prompt_logprobs),
            structured_output=self.structured_output,
        )  # fmt: skip

    def _max_tokens(self, prompt_len: int, max_model_len: int) -> int:
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", "prompt")
        room = max_model_len - prompt_len
        wanted = self.max_tokens if self.max_tokens is not None else room
        if room < 1 or wanted > room:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + max(wanted, 1)} tokens ({prompt_len} in the prompt, "
                f"{max(wanted, 1)} for the completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )
        return wanted

    def _check_ids(self, vocab_size: int) -> None:
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequest(
                    f"'{name}' holds token id {bad[0]}, outside the vocabulary (size {vocab_size})",
                    name,
                )


def within_limit(value: int | None, info: ValidationInfo, limit: str) -> int | None:
    """`value` (a request field being validated) when the server's `limit`, a RequestLimits
    field, allows it; a ValueError naming the flag otherwise. `parse` passes the limits."""
    limits = (info.context or {}).get("limits") or RequestLimits()
    most = getattr(limits, limit)
    if value is not None and value > most:
        flag = "--" + limit.replace("_", "-")
        raise ValueError(f"must be at most {most} on this server ({flag}), not {value}")
    return value


def check_token_budget(max_tokens: Sequence[int], limits: RequestLimits) -> None:
    """400 when the choices' max_tokens (resolved: unset is the context left) add up to more
    than --max-request-tokens."""
    total, most = sum(max_tokens), limits.max_request_tokens
    if most and total > most:
        raise InvalidRequest(
            f"This request may generate up to {total} tokens (max_tokens x n over its prompts; "
            "an unset max_tokens counts as the context left after the prompt), over this "
            f"server's budget of {most} tokens per request (--max-request-tokens). Lower "
            "max_tokens or n.",
            "max_tokens",
        )


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Per-request budgets of the gateway (services.config.RequestLimits); `tessera serve`
    takes them too and passes them on with `limit_flags`."""
    d = RequestLimits()
    p.add_argument(
        "--max-n", type=int, default=d.max_n, help=f"most choices (n) per request ({d.max_n})"
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=d.max_logprobs,
        help=f"most logprobs / top_logprobs per token ({d.max_logprobs})",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=d.max_request_tokens,
        help="most tokens one request may generate: n x max_tokens over its prompts, unset "
        f"max_tokens counting as the context left; 0: no cap ({d.max_request_tokens})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        help="seconds before a request is aborted (408 / DEADLINE_EXCEEDED); 0: none; a "
        "shorter `timeout` body field or gRPC deadline wins",
    )


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The `add_limit_args` options of `args`."""
    return RequestLimits(
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_request_tokens=args.max_request_tokens,
        request_timeout_s=args.request_timeout,
    )


def limit_flags(args: argparse.Namespace) -> list[str]:
    """The `add_limit_args` options of `args` as gateway command-line flags; ValueError
    when they are out of range (checked here, before any service starts)."""
    limits = limits_from_args(args)
    return [
        "--max-n", str(limits.max_n), "--max-logprobs", str(limits.max_logprobs),
        "--max-request-tokens", str(limits.max_request_tokens),
        "--request-timeout", str(limits.request_timeout_s),
    ]  # fmt: skip


def add_media_args(p: argparse.ArgumentParser) -> None:
    """Image options of the gateway (vision-language models); `tessera serve` takes them too
    and passes them on with `media_flags`."""
    p.add_argument(
        "--limit-images-per-prompt", type=int, default=8, help="images one prompt may carry"
    )
    p.add_argument("--max-image-bytes", default="20MiB", help="largest encoded image")
    p.add_argument(
        "--max-image-pixels", type=int, default=4096 * 4096, help="largest width * height"
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        help="hosts http(s) image URLs may come from (none: remote URLs refused)",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds one remote image may take in all (resolve, connect, body)",
    )
    p.add_argument(
        "--max-image-aspect-ratio",
        type=float,
        default=GatewayConfig.max_image_aspect_ratio,
        help="longest / shortest side an image may have (200: 200:1); more gets 400",
    )
    p.add_argument(
        "--allowed-media-networks",
        nargs="*",
        default=[],
        help="CIDRs image hosts may resolve into though not global (loopback, private, "
        "link-local); none: only global addresses are fetched",
    )
    p.add_argument(
        "--image-transport",
        choices=["auto", "shm", "inline"],
        default="auto",
        help="pixels to the worker: shm when it shares this host (auto), or always shm/inline",
    )


def media_flags(args: argparse.Namespace) -> list[str]:
    """The `add_media_args` options of `args` as gateway command-line flags."""
    flags = [
        "--limit-images-per-prompt", str(args.limit_images_per_prompt),
        "--max-image-bytes", str(args.max_image_bytes),
        "--max-image-pixels", str(args.max_image_pixels),
        "--media-fetch-timeout", str(args.media_fetch_timeout),
        "--max-image-aspect-ratio", str(args.max_image_aspect_ratio),
        "--image-transport", args.image_transport,
    ]  # fmt: skip
    if args.allowed_media_domains:
        flags += ["--allowed-media-domains", *args.allowed_media_domains]
    if args.allowed_media_networks:
        flags += ["--allowed-media-networks", *args.allowed_media_networks]
    return flags


def _most(a: int | None, b: int | None) -> int | None:
    """The larger of two optional top-k asks; None when neither asks."""
    return b if a is None else a if b is None else max(a, b)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """Chat rendering and output parsing options of the gateway (vLLM's flags); `tessera
    serve` passes them on with `chat_flags`."""
    p.add_argument("--chat-template", default="", help="Jinja chat template file to use instead")
    p.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="message content as strings or lists of parts; auto: from the template",
    )
    p.add_argument(
        "--reasoning-parser",
        default="",
        choices=["", *REASONING_PARSERS],
        help="put thinking text into reasoning_content (qwen3, deepseek_r1); default off",
    )
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *TOOL_CALL_PARSERS],
        help="tool-call format of tool_choice auto; auto: from the model's tokenizer",
    )


def chat_flags(args: argparse.Namespace) -> list[str]:
    """The `add_chat_args` options of `args` as gateway command-line flags."""
    return [
        "--chat-template", args.chat_template, "--reasoning-parser", args.reasoning_parser,
        "--chat-template-content-format", args.chat_template_content_format,
        "--tool-call-parser", args.tool_call_parser,
    ]  # fmt: skip
