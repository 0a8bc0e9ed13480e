"""The EngineCoreOutput updates the scheduler publishes for a request (pure builders)."""

from __future__ import annotations

import time

from scheduler_service.request import Request, RequestStatus
from scheduler_service.stop import check_stop
from services.types import EngineCoreOutput, FinishReason, TokenLogprobs

_UNSPECIFIED = FinishReason.UNSPECIFIED


def append_until_stop(
    request: Request, token_ids: list[int], eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Append sampled tokens up to the first that stops the request: (appended, stop status)."""
    if len(token_ids) == 1:  # the usual case: one sampled token
        request.append_output_token(token_ids[0])
        return token_ids, check_stop(request, eos_token_ids, max_model_len)
    for i, token_id in enumerate(token_ids):
        request.append_output_token(token_id)
        status = check_stop(request, eos_token_ids, max_model_len)
        if status is not None:
            return token_ids[: i + 1], status
    return token_ids, None


def token_output(
    request: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs]
) -> EngineCoreOutput:
    """New tokens with their logprobs (and the prompt logprobs not yet sent); the caller
    sets a finish reason."""
    if not request.timestamps.first_token:
        request.timestamps.first_token = time.time()
    if len(logprobs) > len(new_token_ids):
        logprobs = logprobs[: len(new_token_ids)]
    output = EngineCoreOutput(
        request.request_id,
        new_token_ids,
        logprobs,
        _UNSPECIFIED,
        None,
        request.num_cached_tokens,
        request.timestamps,
    )
    if request.pending_prompt_logprobs:
        output.prompt_logprobs, request.pending_prompt_logprobs = (
            request.pending_prompt_logprobs,
            [],
        )
    return output


def final_output(request: Request) -> EngineCoreOutput:
    """The last update of a finished request: its finish reason (and error), no tokens."""
    return EngineCoreOutput(
        request.request_id,
        finish_reason=request.status.finish_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        timestamps=request.timestamps,
        error=request.error,
    )
