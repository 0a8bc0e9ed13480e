"""Sliding-window models in the block manager (issue 22): when every layer is windowed the
KV spec carries the window and a request's blocks wholly before it are freed as it advances
(the pool's free count rises mid-generation), outputs still equal HF's; a model with a
global layer keeps every block. A real Scheduler drives a real in-process worker."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from scheduler_service.scheduler import Scheduler
from services.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from services.types import FinishReason
from tests.scheduler.helpers import make_request
from tests.worker.tiny_dense import NEW_TOKENS, eight_prompts, hf_reference, save_tiny
from worker_service.worker import Worker

NUM_BLOCKS = 96


def _run(model: Path) -> tuple[dict[str, list[int]], list[int], int]:
    """Greedy outputs by request, the pool's free count after each step until the first
    request finishes, and the window."""
    worker = Worker(
        WorkerConfig(
            model=ModelConfig(model=str(model), dtype="float32"),
            cache=CacheConfig(block_size=16),
            max_num_seqs=8,
            attention_backend="cpu",
        )
    )
    window = worker.get_kv_cache_spec().sliding_window
    worker.initialize_cache(NUM_BLOCKS)
    config = SchedulerConfig(max_num_batched_tokens=48, async_scheduling=False)
    sched = Scheduler(
        config, num_blocks=NUM_BLOCKS, block_size=16, max_model_len=256, sliding_window=window
    )
    for k, prompt in enumerate(eight_prompts()):
        sched.add_request(
            make_request(
                f"r{k}", prompt, max_model_len=256, max_tokens=NEW_TOKENS, temperature=0.0,
                ignore_eos=True,
            )
        )  # fmt: skip
    outputs: dict[str, list[int]] = {f"r{k}": [] for k in range(8)}
    free_counts, finished = [], False
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for out in sched.update_from_output(so, worker.execute_model(so)):
            assert not out.error, out.error
            outputs[out.request_id] += out.new_token_ids
            finished |= out.finish_reason != FinishReason.UNSPECIFIED
        if not finished:
            free_counts.append(sched.kv.pool.num_free_blocks)
    assert sched.kv.pool.num_free_blocks == NUM_BLOCKS  # everything back at the end
    worker.shutdown()
    return outputs, free_counts, window


def _rises(free_counts: list[int]) -> bool:
    """Whether the free count went up on some step (before any request finished)."""
    return any(b > a for a, b in itertools.pairwise(free_counts))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("mistral", tmp_path_factory.mktemp("mistral"), sliding_window=16)


def test_out_of_window_blocks_are_freed(mistral: Path) -> None:
    outputs, free_counts, window = _run(mistral)
    assert window == 16
    expected = hf_reference(mistral, eight_prompts())
    assert [outputs[f"r{k}"] for k in range(8)] == expected
    # every request needs at most 3 blocks at a time (16-token window, 16-token blocks, plus
    # the chunk being written), so the pool never runs as low as keeping all would need
    assert min(free_counts) > NUM_BLOCKS - sum(
        -(-(n + NEW_TOKENS) // 16) for n in map(len, eight_prompts())
    )
    assert _rises(free_counts)


def test_a_global_layer_keeps_every_block(tmp_path: Path) -> None:
    qwen2 = save_tiny(
        "qwen2", tmp_path, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )  # layer 0 global, layer 1 windowed
    outputs, free_counts, window = _run(qwen2)
    assert window == 0
    assert not _rises(free_counts)
    assert [outputs[f"r{k}"] for k in range(8)] == hf_reference(qwen2, eight_prompts())
