"""Hand-worked scheduling steps (block size 4 everywhere)."""

from __future__ import annotations

from scheduler_service.request import RequestStatus
from services.step_types import ModelRunnerOutput
from services.types import FinishReason
from tests.scheduler.helpers import (
    expected_tokens,
    make_request,
    make_scheduler,
    run_until_idle,
    step,
)

SYSTEM = list(range(100, 112))  # a 12-token shared system prompt = 3 full blocks


def test_reference_step_budget_6() -> None:
    """The seeds' example: A gets a 4-token chunk, B one decode token, C one token after a hit."""
    sched, worker = make_scheduler(max_num_batched_tokens=6, long_prefill_token_threshold=4)
    shared = list(range(100, 108))  # two full blocks
    sched.add_request(make_request("P", [*shared, 200], max_tokens=1))
    sched.add_request(make_request("B", [1, 2, 3], max_tokens=20))
    while "P" in sched.requests:
        step(sched, worker)
    b = sched.requests["B"]
    assert b.num_output_tokens >= 1 and b.num_computed_tokens == b.num_tokens - 1  # decoding

    sched.add_request(make_request("A", list(range(10, 20))))
    sched.add_request(make_request("C", [*shared, 300]))
    out, _ = step(sched, worker)

    assert out.num_scheduled_tokens == {"B": 1, "A": 4, "C": 1}
    assert out.total_num_scheduled_tokens == 6
    assert out.scheduled_cached_reqs.req_ids == ["B"]  # a delta only
    new = {r.request_id: r for r in out.scheduled_new_reqs}
    assert new["A"].num_computed_tokens == 0 and len(new["A"].block_ids) == 1
    assert new["C"].num_computed_tokens == 8 and len(new["C"].block_ids) == 3
    assert sched.requests["C"].num_cached_tokens == 8


def test_four_prompt_tokens_and_three_outputs_end_with_seven_tokens_six_computed() -> None:
    sched, worker = make_scheduler()
    request = make_request("R", [10, 11, 12, 13], max_tokens=3)
    sched.add_request(request)
    scheduled, streamed = [], []
    while sched.has_unfinished_requests():
        out, updates = step(sched, worker)
        scheduled.append(out.num_scheduled_tokens["R"])
        streamed += [t for u in updates for t in u.new_token_ids]
    assert scheduled == [4, 1, 1]
    assert streamed == [14, 15, 16]
    assert request.num_tokens == 7 and request.num_computed_tokens == 6
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_later_requests_hit_a_shared_system_prompt() -> None:
    sched, worker = make_scheduler()
    sched.add_request(make_request("first", [*SYSTEM, 1, 2], max_tokens=2))
    run_until_idle(sched, worker)
    sched.add_request(make_request("second", [*SYSTEM, 7, 8, 9], max_tokens=2))
    sched.add_request(make_request("third", [*SYSTEM, 5], max_tokens=2))
    out, first = step(sched, worker)
    assert out.num_scheduled_tokens == {"second": 3, "third": 1}
    second, third = out.scheduled_new_reqs
    assert second.num_computed_tokens == third.num_computed_tokens == 12
    assert second.block_ids[:3] == third.block_ids[:3]  # the same physical blocks
    shared = [sched.kv.pool.blocks[i] for i in second.block_ids[:3]]
    assert all(b.ref_cnt == 2 for b in shared)
    assert [u.num_cached_tokens for u in first] == [12, 12]
    streamed = run_until_idle(sched, worker)
    assert first[0].new_token_ids + streamed["second"] == expected_tokens([9], 2)
    assert sched.kv.prefix_queries == 14 + 15 + 13
    assert sched.kv.prefix_hits == 24


def test_the_last_prompt_token_is_always_computed() -> None:
    sched, worker = make_scheduler()
    prompt = list(range(50, 58))  # exactly two blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_until_idle(sched, worker)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out, updates = step(sched, worker)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4  # not 8
    assert out.num_scheduled_tokens == {"b": 4}
    assert updates[0].new_token_ids == [58] and updates[0].num_cached_tokens == 4


def test_cache_salt_and_disabled_caching_prevent_hits() -> None:
    sched, worker = make_scheduler()
    sched.add_request(make_request("a", [*SYSTEM, 1], cache_salt="tenant-a", max_tokens=1))
    run_until_idle(sched, worker)
    sched.add_request(make_request("b", [*SYSTEM, 1], cache_salt="tenant-b", max_tokens=1))
    sched.add_request(make_request("c", [*SYSTEM, 1], cache_salt="tenant-a", max_tokens=1))
    out, _ = step(sched, worker)
    hits = {r.request_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    assert hits == {"b": 0, "c": 12}

    sched, worker = make_scheduler(enable_prefix_caching=False)
    sched.add_request(make_request("a", [*SYSTEM, 1], max_tokens=1))
    run_until_idle(sched, worker)
    sched.add_request(make_request("b", [*SYSTEM, 1], max_tokens=1))
    out, _ = step(sched, worker)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert not sched.kv.pool.cached


def test_chunked_prefill_then_decode_and_max_num_seqs() -> None:
    sched, worker = make_scheduler(max_num_batched_tokens=5, max_num_seqs=2)
    for rid in "xyz":
        sched.add_request(make_request(rid, list(range(20, 32)), max_tokens=2))
    out, updates = step(sched, worker)
    assert out.num_scheduled_tokens == {"x": 5}  # the budget caps the first chunk
    assert updates == []  # no token at the end of a partial chunk
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"x": 5}
    out, updates = step(sched, worker)
    assert out.num_scheduled_tokens == {"x": 2, "y": 3}
    assert [u.new_token_ids for u in updates] == [[32]]
    out, _ = step(sched, worker)
    assert set(out.num_scheduled_tokens) == {"x", "y"}  # z waits: max_num_seqs = 2
    streamed = run_until_idle(sched, worker)
    assert streamed["z"] == expected_tokens([31], 2)


def test_token_sampled_inside_a_partial_prefill_is_discarded() -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=4)
    request = make_request("r", list(range(10)))
    sched.add_request(request)
    out = sched.schedule()
    bogus = ModelRunnerOutput(out.step_id, ["r"], num_sampled=[1], sampled_token_ids=[999])
    assert sched.update_from_output(out, bogus) == []
    assert request.num_tokens == 10 and request.num_computed_tokens == 4


def test_preemption_victim_goes_to_the_front_and_resumes() -> None:
    """Two decoding requests outgrow a 5-block pool; the later one is preempted, then resumes."""
    sched, worker = make_scheduler(num_blocks=5)
    sched.add_request(make_request("old", list(range(10, 17)), max_tokens=8))  # 7 tokens
    sched.add_request(make_request("new", list(range(40, 47)), max_tokens=8))
    sched.add_request(make_request("late", [1, 2], max_tokens=1))
    preempted_at = None
    resumed = None
    streamed: dict[str, list[int]] = {}
    for i in range(40):
        if not sched.has_unfinished_requests():
            break
        out, updates = step(sched, worker)
        for u in updates:
            streamed.setdefault(u.request_id, []).extend(u.new_token_ids)
        if out.preempted_req_ids and preempted_at is None:
            preempted_at = i
            assert out.preempted_req_ids == ["new"]
            assert sched.requests["new"].status == RequestStatus.PREEMPTED
            assert sched.requests["new"].block_ids == []
            assert sched.waiting.peek().request_id == "new"  # front, ahead of "late"
        for new in out.scheduled_new_reqs:
            if new.request_id == "new" and new.resumed_from_preemption:
                resumed = new
    assert preempted_at is not None and resumed is not None
    assert resumed.output_token_ids == streamed["new"][: len(resumed.output_token_ids)]
    assert len(resumed.output_token_ids) > 0
    assert streamed["old"] == expected_tokens([16], 8)
    assert streamed["new"] == expected_tokens([46], 8)
    assert sched.num_preemptions >= 1
    assert sched.kv.pool.num_free_blocks == 5


def test_priority_policy_preempts_the_least_important_first() -> None:
    sched, worker = make_scheduler(num_blocks=4, policy="priority")
    sched.add_request(make_request("low", list(range(10, 17)), priority=5, max_tokens=6))
    sched.add_request(make_request("high", list(range(40, 47)), priority=0, max_tokens=6))
    out, _ = step(sched, worker)
    assert [r.request_id for r in out.scheduled_new_reqs] == ["high", "low"]
    victims = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, worker)
        victims += out.preempted_req_ids
    assert victims and set(victims) == {"low"}


def test_stops_eos_stop_ids_min_tokens_and_max_model_len() -> None:
    sched, worker = make_scheduler(eos_token_ids=(13,), max_model_len=16)
    sched.add_request(make_request("eos", [10], max_tokens=10))
    sched.add_request(make_request("ignore", [10], max_tokens=4, ignore_eos=True))
    sched.add_request(make_request("min", [10], max_tokens=10, min_tokens=5))
    sched.add_request(make_request("stopid", [20], max_tokens=10, stop_token_ids=(22,)))
    sched.add_request(make_request("len", [40] * 12, max_tokens=None))
    finals = {}
    while sched.has_unfinished_requests():
        for u in step(sched, worker)[1]:
            if u.finished:
                finals[u.request_id] = (u.finish_reason, u.stop_reason)
    assert finals["eos"] == (FinishReason.STOP, None)
    assert finals["ignore"] == (FinishReason.LENGTH, None)
    assert finals["min"] == (FinishReason.LENGTH, None)  # EOS at 3 tokens is below min_tokens
    assert finals["stopid"] == (FinishReason.STOP, 22)
    assert finals["len"] == (FinishReason.LENGTH, None)  # 12 + 4 = max_model_len


def test_abort_waiting_and_running_frees_blocks_and_tells_the_worker() -> None:
    sched, worker = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", list(range(9)), max_tokens=50))
    sched.add_request(make_request("wait", list(range(9)), max_tokens=50))
    step(sched, worker)
    outputs = sched.abort_requests(["run", "wait", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("run", FinishReason.ABORT),
        ("wait", FinishReason.ABORT),
    ]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    out, _ = step(sched, worker)
    assert out.finished_req_ids == ["run"]  # "wait" never reached the worker
    assert "run" not in worker.requests


def test_failed_step_invents_no_progress_and_fails_only_its_requests() -> None:
    sched, worker = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, [1, 2, 3, 4, 5], max_tokens=4))
    step(sched, worker)
    a = sched.requests["a"]
    before = (a.num_tokens, a.num_computed_tokens)
    out = sched.schedule()
    outputs = sched.fail_step(out, "boom")
    assert {(o.request_id, o.finish_reason, o.error) for o in outputs} == {
        ("a", FinishReason.ERROR, "boom"),
        ("b", FinishReason.ERROR, "boom"),
    }
    assert (a.num_tokens, a.num_computed_tokens) == before
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    streamed = run_until_idle(sched, worker)  # c was waiting: untouched, it runs normally
    assert streamed["c"] == expected_tokens([5], 4)


def test_per_request_errors_fail_only_those_requests() -> None:
    sched, worker = make_scheduler()
    sched.add_request(make_request("ok", [1, 2, 3], max_tokens=3))
    sched.add_request(make_request("bad", [7, 8, 9], max_tokens=3))
    worker.fail_requests["bad"] = "nan in logits"
    streamed: dict[str, list[int]] = {}
    errors = {}
    while sched.has_unfinished_requests():
        for u in step(sched, worker)[1]:
            streamed.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finish_reason == FinishReason.ERROR:
                errors[u.request_id] = u.error
    assert errors == {"bad": "nan in logits"}
    assert streamed["ok"] == [4, 5, 6]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
