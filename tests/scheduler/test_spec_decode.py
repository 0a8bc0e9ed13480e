"""The scheduler's half of speculative decoding, against hand-written worker outputs."""

from __future__ import annotations

import pytest

from scheduler_service.request import RequestStatus
from scheduler_service.scheduler import Scheduler
from services.config import SchedulerConfig, SpeculativeConfig
from services.step_types import DraftTokens, ModelRunnerOutput, SchedulerOutput
from services.types import FinishReason
from tests.scheduler.helpers import make_request

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)


def _scheduler(spec: SpeculativeConfig | None = SPEC, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, speculative_config=spec)
    return Scheduler(config, num_blocks=16, block_size=4, max_model_len=64, eos_token_ids=(99,))


def _output(so: SchedulerOutput, tokens: dict[str, list[int]], drafts: dict[str, list[int]]):
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(
        so.step_id, draft_token_ids=[DraftTokens(i, d) for i, d in drafts.items()]
    )
    out.set_sampled(ids, [tokens.get(i, []) for i in ids])
    return out


def _prefill(scheduler: Scheduler, max_tokens: int = 20) -> SchedulerOutput:
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=max_tokens))
    so = scheduler.schedule()
    scheduler.update_from_output(so, _output(so, {"a": [6]}, {"a": [7, 8, 9]}))
    return so


def test_drafts_are_scheduled_as_extra_tokens_and_rejected_ones_rolled_back() -> None:
    scheduler = _scheduler()
    _prefill(scheduler)
    request = scheduler.requests["a"]
    assert request.spec_token_ids == [7, 8, 9] and request.num_computed_tokens == 5
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 4}  # the last token + 3 drafts
    assert so.scheduled_spec_decode_tokens == [DraftTokens("a", [7, 8, 9])]
    assert len(request.block_ids) * 4 >= 6 + 3  # slots for every draft
    outputs = scheduler.update_from_output(so, _output(so, {"a": [7, 5]}, {"a": [1, 2]}))
    assert outputs[0].new_token_ids == [7, 5]  # one accepted draft + the correction
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 5]
    assert request.num_computed_tokens == 7  # KV of 6 and 7; 8 and 9 rolled back
    assert request.num_inflight_tokens == 0 and request.num_output_placeholders == 0
    stats = scheduler.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 3)
    assert stats.spec_decode_num_accepted_tokens == 1
    so = scheduler.schedule()  # the new drafts, after the two tokens just committed
    assert so.num_scheduled_tokens == {"a": 3}
    assert so.scheduled_cached_reqs.num_computed_tokens[0] == 7


def test_drafts_are_cut_to_max_tokens_and_budget() -> None:
    scheduler = _scheduler()
    _prefill(scheduler, max_tokens=3)  # 1 output so far: 2 more at most = 1 draft + 1
    assert scheduler.schedule().num_scheduled_tokens == {"a": 2}
    tight = _scheduler(budget=2)
    _prefill(tight)
    assert tight.schedule().num_scheduled_tokens == {"a": 2}


def test_a_stop_inside_the_accepted_tokens_ends_the_request() -> None:
    scheduler = _scheduler()
    _prefill(scheduler)
    so = scheduler.schedule()
    outputs = scheduler.update_from_output(so, _output(so, {"a": [7, 99, 9, 4]}, {}))
    assert outputs[0].new_token_ids == [7, 99] and outputs[0].finish_reason == FinishReason.STOP
    assert scheduler.kv.pool.num_used_blocks == 0


def test_a_wrong_token_count_fails_only_that_request() -> None:
    scheduler = _scheduler()
    _prefill(scheduler)
    so = scheduler.schedule()
    (out,) = scheduler.update_from_output(so, _output(so, {"a": [7, 8, 9, 1, 2]}, {}))
    assert out.finish_reason == FinishReason.ERROR and "drafts" in out.error
    assert scheduler.kv.pool.num_used_blocks == 0


def test_abort_with_drafts_in_flight_frees_every_block() -> None:
    scheduler = _scheduler()
    _prefill(scheduler)
    so = scheduler.schedule()
    scheduler.abort_requests(["a"])
    assert scheduler.update_from_output(so, _output(so, {"a": [7, 8]}, {"a": [1]})) == []
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks


def test_preemption_drops_pending_drafts() -> None:
    scheduler = _scheduler()
    _prefill(scheduler)
    request = scheduler.requests["a"]
    from scheduler_service.step_plan import StepPlan

    scheduler._preempt(request, StepPlan(64))
    assert request.spec_token_ids == [] and request.status == RequestStatus.PREEMPTED


def test_without_speculation_worker_drafts_are_ignored() -> None:
    scheduler = _scheduler(spec=None)
    _prefill(scheduler)
    assert scheduler.requests["a"].spec_token_ids == []
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}


def test_speculation_turns_async_scheduling_off() -> None:
    assert SchedulerConfig().use_async_scheduling
    assert not SchedulerConfig(speculative_config=SPEC).use_async_scheduling


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"method": "eagle"}', "must be one of"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "ngram", "model": "x"}', "draft_model"),
        ('{"method": "draft_model"}', "draft_model"),
        ('{"k": 3}', "unknown"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_speculative_configs(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(text)


def test_speculative_config_defaults_and_round_trip() -> None:
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    one = SpeculativeConfig.parse({"prompt_lookup_max": 3})
    assert one is not None and (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.parse(spec.to_json()) == spec
    assert SpeculativeConfig.parse("") is None and SpeculativeConfig.parse(None) is None
