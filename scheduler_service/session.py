"""The buffer between the engine's published updates and one GenerateStream call.

A GenerateStream session multiplexes many requests of one client (the
gateway) on one call. The engine publishes each step's updates once; every
update of the session's requests lands here, and the writer sends everything
pending as one `EngineCoreOutputs` message, so a step costs one message per
connection instead of one per request. When the writer falls behind, the
updates of each request are merged (`merge_outputs`).
"""

from __future__ import annotations

import asyncio

from services.convert import fill_proto
from services.pb import engine_pb2
from services.types import EngineCoreOutput, FinishReason

_ERROR = FinishReason.ERROR


class Session:
    """Pending updates and rejections of one GenerateStream call; event-loop thread only."""

    __slots__ = ("_loop", "_outputs", "_rejections", "_stats", "_waiter", "input_done", "live")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._outputs: list[EngineCoreOutput] = []
        self._rejections: list[engine_pb2.RequestRejection] = []
        self._stats: engine_pb2.SchedulerStats | None = None  # rides on the next message
        self._waiter: asyncio.Future[None] | None = None
        self.live: set[str] = set()  # submitted, not finished, not aborted
        self.input_done = False  # the caller closed its side (or it broke)

    @property
    def done(self) -> bool:
        """Nothing more will be sent: the input is closed, no request lives, nothing pends."""
        return self.input_done and not self.live and not self._outputs and not self._rejections

    def put(self, output: EngineCoreOutput) -> None:
        """Queue an update of one of the session's requests."""
        self._outputs.append(output)
        if output.finished:
            self.live.discard(output.request_id)
        self.wake()

    def set_stats(self, stats: engine_pb2.SchedulerStats) -> None:
        """The scheduler's latest figures, sent with the next message (not a message alone)."""
        self._stats = stats

    def reject(self, request_id: str, code: int, message: str) -> None:
        """Queue the refusal of a request that was never queued in the engine."""
        self._rejections.append(
            engine_pb2.RequestRejection(request_id=request_id, code=code, message=message)
        )
        self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> engine_pb2.EngineCoreOutputs | None:
        """Wait for something to send; None once the session is done."""
        while not (self._outputs or self._rejections):
            if self.done:
                return None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        msg = engine_pb2.EngineCoreOutputs(rejections=self._rejections, stats=self._stats)
        outputs, self._outputs, self._rejections, self._stats = self._outputs, [], [], None
        for output in merge_by_request(outputs):
            fill_proto(msg.outputs.add(), output)
        return msg


def merge_by_request(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """One update per request where several piled up (order kept within each request)."""
    if len({o.request_id for o in outputs}) == len(outputs):
        return outputs
    groups: dict[str, list[EngineCoreOutput]] = {}
    for output in outputs:
        groups.setdefault(output.request_id, []).append(output)
    return [m for group in groups.values() for m in merge_outputs(group)]


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
