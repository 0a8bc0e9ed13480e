"""Engine outputs of one request -> text deltas: incremental detokenization plus stop strings.

Free of HTTP and gRPC concerns: the REST and gRPC APIs use it through
gateway.serving, and the offline `tessera.LLM` API can use it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.detokenizer import Decoder, IncrementalDetokenizer
from gateway.errors import EngineError
from gateway.stop import StopStringMatcher
from services.types import EngineCoreOutput, FinishReason, TokenLogprobs


@dataclass
class ChoiceDelta:
    """What one update added to one choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" on the last delta
    stop_reason: int | str | None = None  # stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class OutputProcessor:
    """Detokenizes and stop-checks the outputs of one engine request (one choice).

    When `on_output` returns a delta whose finish_reason is "stop" because of a stop
    string, the caller must end the engine request (cancel its stream or abort it).
    """

    def __init__(
        self,
        index: int,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.index = index
        self.include_stop = include_stop_str_in_output
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
        self.stop = StopStringMatcher(stop, include_stop_str_in_output)

    def on_output(self, out: EngineCoreOutput) -> ChoiceDelta:
        """The delta for one engine output; finish_reason is set when the choice ended."""
        if out.finish_reason == FinishReason.ERROR:
            raise EngineError(f"the engine failed: {out.error or 'unknown error'}")
        delta = ChoiceDelta(
            self.index,
            self._text(out),
            list(out.new_token_ids),
            list(out.new_logprobs),
            list(out.prompt_logprobs),
            num_cached_tokens=out.num_cached_tokens,
        )
        if self.stop.stopped:
            delta.finish_reason, delta.stop_reason = "stop", self.stop.matched
        elif out.finished:
            delta.finish_reason, delta.stop_reason = out.finish_reason.openai_name, out.stop_reason
        return delta

    def _text(self, out: EngineCoreOutput) -> str:
        ids = out.new_token_ids
        if out.finish_reason == FinishReason.STOP and ids and not self.include_stop:
            ids = ids[:-1]  # the EOS or stop token id that ended the request is not text
        text = self.stop.feed(self.detok.update(ids))
        if out.finished and not self.stop.stopped:
            text += self.stop.feed(self.detok.flush())
            text += self.stop.flush()
        return text
