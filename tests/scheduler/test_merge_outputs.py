"""merge_outputs: updates that pile up while a session's writer is behind merge into one."""

from __future__ import annotations

from scheduler_service.session import merge_outputs
from services.types import EngineCoreOutput, FinishReason, RequestTimestamps, TokenLogprobs


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5, 1)


def test_merge_concatenates_tokens_and_takes_the_latest_status() -> None:
    first = EngineCoreOutput("a", [1], [_lp(1)], timestamps=RequestTimestamps(1.0, 2.0, 3.0))
    second = EngineCoreOutput("a", [2], [_lp(2)])
    last = EngineCoreOutput("a", [3], [_lp(3)], FinishReason.LENGTH, 7, 4)
    merged = merge_outputs([first, second, last])
    assert len(merged) == 1
    out = merged[0]
    assert out.new_token_ids == [1, 2, 3]
    assert [lp.token_id for lp in out.new_logprobs] == [1, 2, 3]
    assert (out.finish_reason, out.stop_reason, out.num_cached_tokens) == (
        FinishReason.LENGTH,
        7,
        4,
    )
    assert first.new_token_ids == [1] and first.new_logprobs == [_lp(1)]  # inputs untouched


def test_an_error_update_is_not_folded_into_tokens() -> None:
    tokens = EngineCoreOutput("a", [1])
    error = EngineCoreOutput("a", finish_reason=FinishReason.ERROR, error="boom")
    merged = merge_outputs([tokens, EngineCoreOutput("a", [2]), error])
    assert [o.new_token_ids for o in merged] == [[1, 2], []]
    assert merged[1].error == "boom" and merged[1].finish_reason == FinishReason.ERROR


def test_prompt_logprobs_of_the_first_update_survive_a_merge() -> None:
    first = EngineCoreOutput("a", [5], prompt_logprobs=[_lp(9), _lp(8)])
    merged = merge_outputs([first, EngineCoreOutput("a", [6])])
    assert [lp.token_id for lp in merged[0].prompt_logprobs] == [9, 8]
    assert merged[0].new_token_ids == [5, 6]
