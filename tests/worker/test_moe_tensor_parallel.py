"""Issue 22, MoE under tensor parallelism: experts split by intermediate size (each rank holds
its slice of every expert's gate/up rows and down columns, summed by one all-reduce), and
Qwen2-MoE's shared expert and dense layers split the same way; 2 ranks (gloo, float32) give
HF's greedy tokens with chunked prefill. OLMoE's whole-projection q/k norm sums its mean
square over the ranks' heads (one small all-reduce per layer). With expert parallelism the
ranks hold whole experts, split by expert id."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.hf_reference import hf_greedy
from tests.worker.test_tensor_parallel import NEW_TOKENS, PROMPTS, _config, _generate
from tests.worker.tiny_moe import save_tiny_moe
from worker_service.models.moe import SparseMoeBlock
from worker_service.worker import Worker


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_tp2_moe_greedy_equals_hf(kind: str, tmp_path: Path, default_model_dir: Path) -> None:
    path = save_tiny_moe(kind, tmp_path / kind, default_model_dir)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS, "float32")
    split = Worker(_config(path, 2))
    try:
        blocks = [m for m in split.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        experts = blocks[0].experts
        full = experts.moe.intermediate
        assert experts.w13.shape[1] == 2 * (full // 2) and experts.w2.shape[2] == full // 2
        if kind == "qwen2_moe":  # 40 shared-expert columns: 20 here
            assert blocks[0].shared_expert is not None
            assert blocks[0].shared_expert.intermediate == 20
        two = _generate(split)
    finally:
        split.shutdown()
    for i in range(len(PROMPTS)):
        assert two[str(i)] == expected[i], f"tp=2 prompt {i}"


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_expert_parallel_greedy_equals_hf(
    kind: str, tmp_path: Path, default_model_dir: Path
) -> None:
    """--enable-expert-parallel: rank 0 holds whole experts 0..E/2-1 (the shared expert and
    attention still split by columns / heads); the partial outputs sum to HF's."""
    path = save_tiny_moe(kind, tmp_path / kind, default_model_dir)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS, "float32")
    config = _config(path, 2)
    parallel = dataclasses.replace(config.parallel, enable_expert_parallel=True)
    split = Worker(dataclasses.replace(config, parallel=parallel))
    try:
        experts = next(
            m for m in split.runner.model.modules() if isinstance(m, SparseMoeBlock)
        ).experts
        assert (experts.expert_start, experts.expert_end) == (0, experts.moe.num_experts // 2)
        assert experts.w13.shape[:2] == (experts.moe.num_experts // 2, 2 * experts.moe.intermediate)
        two = _generate(split)
    finally:
        split.shutdown()
    for i in range(len(PROMPTS)):
        assert two[str(i)] == expected[i], f"ep=2 prompt {i}"


@pytest.mark.parametrize("flag", [True, False])
def test_enable_expert_parallel_reaches_the_worker_config(flag: bool) -> None:
    """`tessera serve --enable-expert-parallel` -> the worker's flag -> ParallelConfig."""
    from tessera.cli import build_parser, build_services
    from worker_service.__main__ import build_config, parse_args

    argv = ["serve", "--kv-cache-memory", "1GiB", "--tensor-parallel-size", "2"]
    services = build_services(
        build_parser().parse_args(argv + ["--enable-expert-parallel"] * flag), "t"
    )
    worker_argv = services[0].argv
    assert worker_argv[2] == "worker_service"
    config = build_config(parse_args(worker_argv[3:]))
    assert config.parallel.enable_expert_parallel is flag
    assert config.parallel.tensor_parallel_size == 2
