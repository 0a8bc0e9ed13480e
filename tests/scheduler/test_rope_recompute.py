"""Phi-3 longrope (issue 22): HF's generate recomputes a sequence's whole cache with the long
factors when it grows past original_max_position_embeddings, so the scheduler recomputes a
request admitted at most that long once its next token goes past it (KVCacheSpec
rope_recompute_length): re-sent whole, once, at length limit + 1; a request admitted longer
is never recomputed, and the tokens continue as before."""

from __future__ import annotations

from tests.scheduler.helpers import expected_tokens, make_request, make_scheduler, step

LIMIT = 8


def test_a_request_crossing_the_limit_is_recomputed_once() -> None:
    sched, worker = make_scheduler(rope_recompute_length=LIMIT, enable_prefix_caching=False)
    sched.add_request(make_request("short", [1, 2, 3, 4, 5, 6], max_tokens=6))
    sched.add_request(make_request("long", list(range(10, 19)), max_tokens=6))  # 9 > LIMIT
    resent: list[tuple[str, int, int]] = []  # (request, tokens sent, computed)
    streamed: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        out, updates = step(sched, worker)
        for new in out.scheduled_new_reqs:
            if new.resumed_from_preemption:
                n = len(new.prompt_token_ids) + len(new.output_token_ids)
                resent.append((new.request_id, n, new.num_computed_tokens))
        for u in updates:
            streamed.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert resent == [("short", LIMIT + 1, 0)]
    assert streamed["short"] == expected_tokens([6], 6)
    assert streamed["long"] == expected_tokens([18], 6)
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_without_a_limit_nothing_is_recomputed() -> None:
    sched, worker = make_scheduler(enable_prefix_caching=False)
    sched.add_request(make_request("short", [1, 2, 3, 4, 5, 6], max_tokens=6))
    while sched.has_unfinished_requests():
        out, _ = step(sched, worker)
        assert not out.preempted_req_ids
        assert not any(n.resumed_from_preemption for n in out.scheduled_new_reqs)
