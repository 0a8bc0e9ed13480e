"""Embedding (pooling) requests in the scheduler: prefill only, chunked like any prompt,
finished (STOP, with the vector) when the last chunk is committed, blocks freed, no
prefix-cache lookups; generate requests in the same steps are unaffected."""

from __future__ import annotations

from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler
from services.step_types import ModelRunnerOutput, PooledOutput, SchedulerOutput
from services.types import EngineCoreOutput, FinishReason, PoolingParams, SamplingParams
from tests.scheduler.helpers import make_request, make_scheduler

VECTOR = b"\x00\x00\x80?\x00\x00\x00@"  # [1.0, 2.0] as little-endian float32


def _pooling(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), 128, pooling_params=PoolingParams())


def _step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """Schedule, then answer as a worker would: a token for each generate request that
    reached its end, a vector for each embedding request that did."""
    so = scheduler.schedule()
    req_ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(so.step_id)
    tokens: list[list[int]] = [[] for _ in req_ids]
    for i, rid in enumerate(req_ids):
        request = scheduler.requests[rid]
        if request.num_computed_tokens + request.num_inflight_tokens < request.num_tokens:
            continue
        if request.pooling_params is None:
            tokens[i] = [7]
        else:
            out.pooler_output.append(PooledOutput(rid, VECTOR))
    out.set_sampled(req_ids, tokens)
    return so, scheduler.update_from_output(so, out)


def test_chunked_pooling_request_finishes_with_its_vector_and_frees_its_blocks() -> None:
    scheduler, _ = make_scheduler(max_num_batched_tokens=16, block_size=4)
    scheduler.add_request(_pooling("e", list(range(1, 41))))  # 40 tokens: 16 + 16 + 8
    scheduler.add_request(make_request("g", [5, 6, 7], max_tokens=4, ignore_eos=True))
    chunks, finals = [], []
    for _ in range(10):
        so, outputs = _step(scheduler)
        if "e" in so.num_scheduled_tokens:
            chunks.append(so.num_scheduled_tokens["e"])
        finals += [o for o in outputs if o.request_id == "e"]
        if not scheduler.has_unfinished_requests():
            break
    assert chunks == [16, 16, 8]
    assert len(finals) == 1, "one update: the final one"
    final = finals[0]
    assert final.finish_reason == FinishReason.STOP and final.pooling_output == VECTOR
    assert final.new_token_ids == []
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.pool.num_used_blocks == 0
    assert scheduler._known == set()


def test_aborted_mid_prefill_frees_its_blocks() -> None:
    scheduler, _ = make_scheduler(max_num_batched_tokens=8, block_size=4)
    scheduler.add_request(_pooling("e", list(range(1, 33))))
    _step(scheduler)
    assert scheduler.kv.pool.num_used_blocks == 2
    (output,) = scheduler.abort_requests(["e"])
    assert output.finish_reason == FinishReason.ABORT and output.pooling_output == b""
    assert scheduler.kv.pool.num_used_blocks == 0


def test_pooling_requests_skip_prefix_hits_but_leave_their_blocks_cached() -> None:
    """Mean / CLS / max pooling (pooled_prefix_hits off) needs every row's hidden state."""
    scheduler, _ = make_scheduler(block_size=4)
    prompt = list(range(1, 18))
    for rid in ("e1", "e2"):
        scheduler.add_request(_pooling(rid, prompt))
        _, outputs = _step(scheduler)
        assert outputs[0].num_cached_tokens == 0  # every row's hidden state is computed
    scheduler.add_request(make_request("g", prompt, max_tokens=1))
    _, outputs = _step(scheduler)
    assert outputs[0].num_cached_tokens == 16  # a generate request reuses their blocks


def test_a_missing_vector_fails_the_request() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add_request(_pooling("e", [1, 2, 3]))
    so = scheduler.schedule()
    out = ModelRunnerOutput(so.step_id, ["e"], num_sampled=[0])
    (output,) = scheduler.update_from_output(so, out)
    assert output.finish_reason == FinishReason.ERROR and "no vector" in output.error
    assert scheduler.kv.pool.num_used_blocks == 0


def test_last_token_pooling_takes_prefix_hits() -> None:
    scheduler, _ = make_scheduler(block_size=4)
    scheduler.pooled_prefix_hits = True  # what the engine sets for a LAST-pooling model
    prompt = list(range(1, 18))
    hits = []
    for rid in ("e1", "e2"):
        scheduler.add_request(_pooling(rid, prompt))
        _, outputs = _step(scheduler)
        assert outputs[0].pooling_output == VECTOR
        hits.append(outputs[0].num_cached_tokens)
    assert hits == [0, 16]  # the last token is always computed
    assert scheduler.kv.pool.num_used_blocks == 0
