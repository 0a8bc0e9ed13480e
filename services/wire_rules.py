"""Behaviour of the wire types: validation, properties, methods; no fields.

The fields, defaults and proto conversions of each type are generated from protos/ into
services/wire.py, whose class `X` inherits `XRules` from here when this module defines one
(scripts/gen_wire_types.py looks for the names). A rule reads the fields through `_fields`,
which only tells mypy what `self` is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Self, cast

if TYPE_CHECKING:
    from services import wire

MAX_LOGPROBS = 20  # top logprobs per token the engine computes at most
MAX_N = 64  # choices per request the gateway accepts at most (--max-n may lower it)


class FinishReasonRules:
    @property
    def openai_name(self) -> str | None:
        """The OpenAI `finish_reason` string; None while running."""
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}.get(int(cast(Any, self)))


class SamplingParamsRules:
    __slots__ = ()

    def __post_init__(self) -> None:
        p = cast("wire.SamplingParams", self)
        _check(p.temperature >= 0 and math.isfinite(p.temperature), "temperature", ">= 0")
        _check(0 < p.top_p <= 1, "top_p", "in (0, 1]")
        _check(p.top_k >= -1, "top_k", "-1, 0 (off) or a positive integer")
        _check(0 <= p.min_p <= 1, "min_p", "in [0, 1]")
        _check(p.max_tokens is None or p.max_tokens >= 1, "max_tokens", ">= 1")
        _check(p.min_tokens >= 0, "min_tokens", ">= 0")
        _check(
            p.max_tokens is None or p.min_tokens <= p.max_tokens,
            "min_tokens",
            f"<= max_tokens ({p.max_tokens})",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2 <= getattr(p, name) <= 2, name, "in [-2, 2]")
        _check(0 < p.repetition_penalty <= 100, "repetition_penalty", "in (0, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(p, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"in [0, {MAX_LOGPROBS}]")
        _check(all(t >= 0 for t in p.stop_token_ids), "stop_token_ids", "non-negative ids")
        _check(all(t >= 0 for t in p.logit_bias), "logit_bias", "keyed by token ids >= 0")
        _check(all(-100 <= b <= 100 for b in p.logit_bias.values()), "logit_bias", "in [-100, 100]")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        p = cast("wire.SamplingParams", self)
        return p.temperature == 0 or p.top_k == 1


class PoolingParamsRules:
    __slots__ = ()

    def __post_init__(self) -> None:
        p = cast("wire.PoolingParams", self)
        _check(p.dimensions is None or p.dimensions >= 1, "dimensions", ">= 1")


class TensorHandleRules:
    __slots__ = ()

    def __post_init__(self) -> None:
        h = cast("wire.TensorHandle", self)
        locations = (h.cuda_ipc, h.shared_memory, h.inline_bytes)
        if sum(loc is not None for loc in locations) != 1:
            raise ValueError("a TensorHandle needs exactly one location")


class LoRARequestRules:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`; `lora_int_id` (> 0) is the
    workers' cache key, unique per adapter."""

    __slots__ = ()

    def __post_init__(self) -> None:
        r = cast("wire.LoRARequest", self)
        if not r.lora_name:
            raise ValueError("a LoRARequest needs a lora_name")
        if type(r.lora_int_id) is not int or r.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, not {r.lora_int_id!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return cast("wire.LoRARequest", self).lora_int_id

    @property
    def name(self) -> str:
        return cast("wire.LoRARequest", self).lora_name

    @property
    def path(self) -> str:
        return cast("wire.LoRARequest", self).lora_path


class TokenLogprobsRules:
    __slots__ = ()

    def ranked(self) -> dict[int, tuple[float, int]]:
        """{token id: (logprob, rank)}: the chosen token first with its own rank, then the
        top-k ranked 1..k, each token once (vLLM's order)."""
        lp = cast("wire.TokenLogprobs", self)
        out = {lp.token_id: (lp.logprob, lp.rank)}
        for rank, (token_id, logprob) in enumerate(
            zip(lp.top_token_ids, lp.top_logprobs, strict=True), start=1
        ):
            out.setdefault(token_id, (logprob, rank))
        return out


class CachedRequestDataRules:
    """vLLM V1's columnar CachedRequestData: one entry per request in each list."""

    __slots__ = ()

    @classmethod
    def of(cls, rows: Iterable[tuple[str, int, list[int]]]) -> Self:
        """Built from `rows()`'s tuples: (request id, tokens computed, blocks appended)."""
        cached = cls()
        for row in rows:
            cached.add(*row)
        return cached

    def add(self, request_id: str, num_computed_tokens: int, new_block_ids: list[int]) -> None:
        c = cast("wire.CachedRequestData", self)
        c.req_ids.append(request_id)
        c.num_computed_tokens.append(num_computed_tokens)
        c.num_new_blocks.append(len(new_block_ids))
        c.new_block_ids.extend(new_block_ids)

    def rows(self) -> Iterator[tuple[str, int, list[int]]]:
        """(request id, tokens computed before this step, blocks appended) per request."""
        c = cast("wire.CachedRequestData", self)
        end = 0
        for request_id, computed, n in zip(
            c.req_ids, c.num_computed_tokens, c.num_new_blocks, strict=True
        ):
            yield request_id, computed, c.new_block_ids[end : end + n]
            end += n


class ModelRunnerOutputRules:
    __slots__ = ()

    def set_sampled(self, req_ids: list[str], tokens: list[list[int]]) -> None:
        """The step's requests and the tokens each sampled (empty: none)."""
        out = cast("wire.ModelRunnerOutput", self)
        out.req_ids = req_ids
        out.num_sampled = [len(t) for t in tokens]
        out.sampled_token_ids = [t for one in tokens for t in one]

    def sampled_by_request(self) -> dict[str, list[int]]:
        """{request id: the tokens it sampled this step (empty: none)} for the step's requests."""
        out = cast("wire.ModelRunnerOutput", self)
        tokens, result, end = out.sampled_token_ids, {}, 0
        for request_id, n in zip(out.req_ids, out.num_sampled, strict=True):
            result[request_id] = tokens[end : end + n]
            end += n
        return result


class EngineCoreOutputRules:
    __slots__ = ()

    @property
    def finished(self) -> bool:
        return cast("wire.EngineCoreOutput", self).finish_reason != 0


def _check(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}")


class StructuredOutputParamsRules:
    """vLLM's StructuredOutputsParams: exactly one of json (a schema as JSON text),
    json_object (True), regex, choice (a list is kept as a tuple) and grammar is set."""

    __slots__ = ()

    def __post_init__(self) -> None:
        p = cast("wire.StructuredOutputParams", self)
        if isinstance(p.choice, list):  # accept a list, keep the object hashable
            object.__setattr__(p, "choice", tuple(p.choice))
        values = (p.json, p.json_object, p.regex, p.choice, p.grammar)
        if sum(v is not None for v in values) != 1:
            raise ValueError(
                "structured_output needs exactly one of json, json_object, regex, choice, grammar"
            )
        _check(p.json_object in (None, True), "json_object", "True when given")
