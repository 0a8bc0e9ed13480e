"""The per-step encoder budget: chunks stop before an image the step cannot encode."""

from __future__ import annotations

from scheduler_service.request import Request
from scheduler_service.scheduler import Scheduler
from services.config import SchedulerConfig
from services.types import MultiModalInput, SamplingParams, TensorHandle
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.helpers import run_until_idle, step

HANDLE = TensorHandle(inline_bytes=b"")


def image(offset: int, length: int, content: str) -> MultiModalInput:
    return MultiModalInput("image", offset, length, content, HANDLE)


def make(encoder_tokens: int, budget: int = 64) -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_encoder_tokens=encoder_tokens)
    scheduler = Scheduler(config, num_blocks=64, block_size=4, max_model_len=256)
    worker = FakeWorker(block_size=4, max_model_len=256)
    worker.initialize_cache(64)
    return scheduler, worker


def request(request_id: str, prompt_len: int, images: list[MultiModalInput]) -> Request:
    params = SamplingParams(max_tokens=2)
    return Request(request_id, list(range(1, prompt_len + 1)), params, 256, mm_inputs=images)


def test_two_images_over_the_budget_take_two_steps() -> None:
    scheduler, worker = make(encoder_tokens=10)
    scheduler.add_request(request("a", 40, [image(2, 8, "x"), image(20, 8, "y")]))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 20}  # cut just before the second image
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 20}  # the rest, second image included


def test_budget_is_shared_by_the_requests_of_a_step() -> None:
    scheduler, worker = make(encoder_tokens=10)
    scheduler.add_request(request("a", 12, [image(2, 8, "x")]))
    scheduler.add_request(request("b", 12, [image(0, 8, "y")]))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 12}  # b's image starts at 0: nothing fits
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens["b"] == 12


def test_an_image_larger_than_the_budget_still_runs_alone() -> None:
    scheduler, worker = make(encoder_tokens=4)
    scheduler.add_request(request("a", 16, [image(2, 8, "x")]))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"a": 16}
    assert set(run_until_idle(scheduler, worker)) <= {"a"}


def test_text_only_requests_ignore_the_encoder_budget() -> None:
    scheduler, worker = make(encoder_tokens=1)
    scheduler.add_request(request("t", 30, []))
    out, _ = step(scheduler, worker)
    assert out.num_scheduled_tokens == {"t": 30}
