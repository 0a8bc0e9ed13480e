"""Per-request buffers between the engine's published updates and a Generate call.

Each step the engine publishes one update per running request, and each update
costs one gRPC message (about 0.1 ms of event-loop time in grpc.aio). When a
stream falls behind (the engine steps faster than the messages go out), the
updates waiting for it are merged into one message: the tokens, logprobs and
prompt logprobs are concatenated and the latest status wins. So the number of
messages adapts to what the transport can carry, and no token is lost.
"""

from __future__ import annotations

import asyncio

from services.types import EngineCoreOutput, FinishReason

_ERROR = FinishReason.ERROR


class OutputStream:
    """The updates of one request not yet written to its stream; event-loop thread only."""

    __slots__ = ("_loop", "_pending", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: list[EngineCoreOutput] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: EngineCoreOutput) -> None:
        """Queue an update and wake the reader if it waits."""
        self._pending.append(output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> list[EngineCoreOutput]:
        """Wait for updates; returns everything queued, merged (see `merge_outputs`)."""
        while not self._pending:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending, self._pending = self._pending, []
        return merge_outputs(pending) if len(pending) > 1 else pending


def merge_outputs(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Fold consecutive updates of one request into one; an ERROR update stays separate.

    Merged: new_token_ids, new_logprobs and prompt_logprobs concatenated in
    order; finish_reason, stop_reason, timestamps and num_cached_tokens from
    the later update. Nothing follows a finished update, so order is kept.
    """
    merged: list[EngineCoreOutput] = []
    for output in outputs:
        last = merged[-1] if merged else None
        if last is None or last.finished or output.finish_reason is _ERROR:
            merged.append(_copy(output))
            continue
        last.new_token_ids.extend(output.new_token_ids)
        last.new_logprobs.extend(output.new_logprobs)
        last.prompt_logprobs.extend(output.prompt_logprobs)
        last.finish_reason = output.finish_reason
        last.stop_reason = output.stop_reason
        last.num_cached_tokens = output.num_cached_tokens
        last.timestamps = output.timestamps
        last.error = output.error
    return merged


def _copy(output: EngineCoreOutput) -> EngineCoreOutput:
    """A copy whose lists may be extended without touching the scheduler's objects."""
    return EngineCoreOutput(
        output.request_id,
        list(output.new_token_ids),
        list(output.new_logprobs),
        output.finish_reason,
        output.stop_reason,
        output.num_cached_tokens,
        output.timestamps,
        output.error,
        list(output.prompt_logprobs),
    )
