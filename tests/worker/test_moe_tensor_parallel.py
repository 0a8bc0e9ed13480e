"""Issue 22, MoE under tensor parallelism: experts split by intermediate size (each rank holds
its slice of every expert's gate/up rows and down columns, summed by one all-reduce), and
Qwen2-MoE's shared expert and dense layers split the same way; 2 ranks (gloo, float32) give
HF's greedy tokens with chunked prefill. OLMoE's whole-projection q/k norm sums its mean
square over the ranks' heads (one small all-reduce per layer)."""

from __future__ import annotations

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
