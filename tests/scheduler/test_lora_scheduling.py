"""Multi-LoRA in the scheduler: the adapter is part of the prefix-cache hash (two adapters
never share KV, one adapter does with itself), at most max_loras distinct adapters run at
once (vLLM's rule; base requests are never held back by it), and the worker is told each new
request's adapter."""

from __future__ import annotations

from scheduler_service.prefix_cache import update_block_hashes
from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler
from services.config import SchedulerConfig
from services.lora_config import LoRAConfig
from services.types import LoRARequest, SamplingParams
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import step

A, B, C = (LoRARequest(n, i, f"/adapters/{n}") for i, n in enumerate("abc", start=1))
SYSTEM = list(range(100, 112))  # 3 full blocks of 4


def _request(rid: str, lora: LoRARequest | None, prompt: list[int] | None = None) -> Request:
    prompt = prompt or [*SYSTEM, 7]
    return Request(rid, prompt, SamplingParams(max_tokens=4), 128, lora_request=lora)


def _scheduler(max_loras: int) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(lora=LoRAConfig(enable_lora=True, max_loras=max_loras))
    scheduler = Scheduler(config, num_blocks=64, block_size=4, max_model_len=128)
    worker = FakeWorker(block_size=4, max_model_len=128)
    worker.initialize_cache(64)
    return scheduler, worker


def test_each_adapter_has_its_own_block_hashes() -> None:
    base, a, a2, b = (update_block_hashes(_request("r", x), 4) for x in (None, A, A, B))
    assert a == a2
    for i in range(3):  # every block differs, through the chain
        assert len({base[i], a[i], b[i]}) == 3
    renamed = LoRARequest("a", 9, "/adapters/a")  # a reloaded adapter gets a new id
    assert update_block_hashes(_request("r", renamed), 4)[0] != a[0]


def test_prefix_hits_stay_within_one_adapter() -> None:
    sched, worker = _scheduler(max_loras=2)
    sched.add_request(_request("a1", A))
    while sched.has_unfinished_requests():
        step(sched, worker)
    sched.add_request(_request("b1", B))
    sched.add_request(_request("base", None))
    sched.add_request(_request("a2", A))
    out, _ = step(sched, worker)
    computed = {r.request_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    assert computed == {"b1": 0, "base": 0, "a2": 12}
    loras = {r.request_id: r.lora_request for r in out.scheduled_new_reqs}
    assert loras == {"b1": B, "base": None, "a2": A}


def test_at_most_max_loras_adapters_run_at_once() -> None:
    sched, worker = _scheduler(max_loras=2)
    for rid, lora in (("a", A), ("base", None), ("b", B), ("c", C), ("a2", A)):
        sched.add_request(_request(rid, lora, [1, 2, 3, 4, 5]))
    out, _ = step(sched, worker)
    assert [r.request_id for r in out.scheduled_new_reqs] == ["a", "base", "b"]  # c waits
    seen: set[int] = set()
    while sched.has_unfinished_requests():
        step(sched, worker)
        running = {r.lora_int_id for r in sched.running if r.lora_request is not None}
        assert len(running) <= 2
        seen |= running
    assert seen == {1, 2, 3}
