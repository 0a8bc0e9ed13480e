"""`TextOptions`: the protocol-neutral sampling and stopping options of one request.

Shared by the REST API (built from the pydantic request models in gateway.protocol)
and the gRPC text API. `TextOptions.sampling_params` checks what only the model
knows (vocabulary, context length) and builds the engine's SamplingParams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import ValidationInfo

from gateway.errors import InvalidRequest
from services.config import RequestLimits
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


def _most(a: int | None, b: int | None) -> int | None:
    """The larger of two optional top-k asks; None when neither asks."""
    return b if a is None else a if b is None else max(a, b)
