"""Grammar-constrained decoding in the worker: one llguidance matcher per constrained request.

Lifecycle: a request with `SamplingParams.structured_output` gets a matcher when it is
added (a copy of a template compiled once per constraint; a resumed request replays its
output tokens into it); each step the constrained sampling rows get a token bitmask that
the sampler applies after logit_bias/penalties and before temperature/top-k/top-p; the
sampled token is then consumed. Once the grammar is complete the mask allows only EOS, so
the request stops with finish_reason "stop". Rows without a constraint cost nothing.
See services/structured_output.py for why llguidance.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from services.structured_output import grammar_text
from services.types import StructuredOutputParams

if TYPE_CHECKING:
    from worker_service.input_batch import RequestState

log = logging.getLogger(__name__)

_TEMPLATES = 256  # compiled constraints kept (LRU); a copy of a template is ~5 us
_THREADS = 2  # mask computation threads (the dev machines have 2 cores)


class StructuredOutputs:
    """Compiles constraints against the model's tokenizer and keeps the batch's masks."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.model_dir, self.vocab_size, self.eos_ids = model_dir, vocab_size, list(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at first use (~1 s)
        self._executor: llguidance.LLExecutor | None = None
        self._templates: collections.OrderedDict[StructuredOutputParams, llguidance.LLMatcher]
        self._templates = collections.OrderedDict()

    def attach(self, state: RequestState, output_token_ids: Sequence[int]) -> None:
        """Give a constrained request its matcher, replaying tokens it already produced.

        ValueError when the constraint does not compile or the tokens break it."""
        params = state.params.structured_output
        if params is None:
            return
        matcher = self._template(params).deep_copy()
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise ValueError(f"structured output: cannot resume: {_error(matcher)}")
        state.matcher = matcher

    def bitmask(self, states: Sequence[RequestState]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [len(rows), ceil(V/32)] int32) for the constrained rows; None if none."""
        rows = [i for i, s in enumerate(states) if s.matcher is not None]
        if not rows:
            return None
        mask = llguidance.torch.allocate_token_bitmask(len(rows), self.vocab_size)
        matchers = [(states[r].matcher, i) for i, r in enumerate(rows)]
        if len(matchers) == 1:
            llguidance.torch.fill_next_token_bitmask(matchers[0][0], mask, 0)
        else:
            llguidance.torch.fill_next_token_bitmask_par(self._get_executor(), matchers, mask)
        return rows, mask

    def accept(self, states: Sequence[RequestState], tokens: Sequence[int]) -> dict[str, str]:
        """Advance each constrained row's matcher by its sampled token; errors by request id."""
        errors = {}
        for state, token in zip(states, tokens, strict=True):
            matcher = state.matcher
            if matcher is not None and not matcher.consume_token(token):
                errors[state.req_id] = f"structured output: {_error(matcher)}"
        return errors

    def _template(self, params: StructuredOutputParams) -> llguidance.LLMatcher:
        template = self._templates.get(params)
        if template is not None:
            self._templates.move_to_end(params)
            return template
        template = llguidance.LLMatcher(self._get_tokenizer(), grammar_text(params))
        if template.is_error():
            raise ValueError(f"structured output: {_error(template)}")
        self._templates[params] = template
        if len(self._templates) > _TEMPLATES:
            self._templates.popitem(last=False)
        return template

    def _get_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(self.model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(
                    hf,  # type: ignore[arg-type]
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_ids,
                )
            except (OSError, ValueError, TypeError) as exc:
                raise ValueError(f"structured output needs the model's tokenizer: {exc}") from exc
            log.info("structured output: tokenizer info built from %s", self.model_dir)
        return self._tokenizer

    def _get_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(_THREADS)
        return self._executor


def _error(matcher: llguidance.LLMatcher) -> str:
    """The first line of the matcher's error (the rest is a parser state dump)."""
    return (matcher.get_error() or "token rejected by the grammar").splitlines()[0]
