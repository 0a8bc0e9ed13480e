"""When a request stops, decided after each appended output token."""

from __future__ import annotations

from collections.abc import Container

from scheduler_service.request import Request, RequestStatus


def check_stop(
    request: Request, eos_token_ids: Container[int], max_model_len: int
) -> RequestStatus | None:
    """The final status the request's last token gives it, or None when it goes on.

    Order (vLLM): below `min_tokens` neither EOS nor stop ids count; then EOS
    (unless ignore_eos) and stop_token_ids (recorded in `request.stop_reason`) give STOP;
    otherwise reaching max_tokens or max_model_len gives LENGTH.
    """
    params = request.sampling_params
    last = request.all_token_ids[-1]
    num_output = request.num_tokens - request.num_prompt_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and last in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if num_output >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
