"""RoPE scaling types (issue 22): a tiny random Llama per type, Tessera greedy == HF generate
token for token in float32 on 8 prompts x 32 tokens, whole and chunked prefill, with lengths
past the configs' small original_max_position_embeddings where the type depends on it; and
unknown rope types / keys refused with an error naming them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.worker.tiny_dense import BUDGETS, assert_parity, save_tiny
from worker_service.models.config import read_model_config

HEAD_HALF = 8  # head_dim 16 / 2: one longrope factor per rotary frequency
ROPES: dict[str, dict[str, Any]] = {
    "linear": dict(max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # NTK scaling switches on for sequences longer than max_position_embeddings (64)
    "dynamic": dict(
        max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
    ),
    "llama3": dict(
        max_position_embeddings=160,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "yarn": dict(
        max_position_embeddings=160,
        rope_theta=500.0,  # low base: the ramp between beta_fast and beta_slow is non-trivial
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # long factors for sequences past 32 tokens: prompts on both sides, decodes crossing it
    "longrope": dict(
        max_position_embeddings=160,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(HEAD_HALF)],
            "long_factor": [1.0 + 0.9 * i for i in range(HEAD_HALF)],
            "original_max_position_embeddings": 32,
        },
    ),
}


@pytest.fixture(scope="module", params=list(ROPES))
def rope_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp(request.param), **ROPES[request.param])


@pytest.mark.parametrize("prefill", list(BUDGETS))
def test_rope_scaling_greedy_matches_hf(rope_model: Path, prefill: str) -> None:
    sched = assert_parity(rope_model, BUDGETS[prefill])
    assert (sched.stats.chunked_steps > 0) == (prefill == "chunked")


def test_rope_type_is_read(rope_model: Path) -> None:
    cfg = read_model_config(rope_model)
    assert (
        cfg.rope.rope_type
        == json.loads((rope_model / "config.json").read_text())["rope_parameters"]["rope_type"]
    )


def _config_dir(tmp_path: Path, **fields: Any) -> Path:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "'proportional'"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "long_factor"),
    ],
)
def test_unknown_rope_is_refused(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_model_config(_config_dir(tmp_path, **fields))


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_mrope_is_refused_by_text_families(tmp_path: Path, architecture: str) -> None:
    """M-RoPE is read from the config but only the Qwen2-VL classes serve it."""
    from worker_service.models.registry import check_features, model_class

    rope = {"type": "linear", "factor": 2.0, "mrope_section": [1]}
    cfg = read_model_config(_config_dir(tmp_path, rope_scaling=rope))
    with pytest.raises(ValueError, match="mrope_section"):
        check_features(model_class(architecture), cfg)


def test_length_dependent_rope_turns_prefix_caching_off(rope_model: Path) -> None:
    """dynamic / longrope keys depend on the prompt length: the KV spec says so and the
    engine then reuses no cached prefix (another length would have rotated it otherwise)."""
    import dataclasses

    import torch

    from scheduler_service.engine import EngineCore
    from services.config import CacheConfig, SchedulerConfig
    from services.step_types import KVCacheSpec
    from tests.scheduler.fake_worker import FakeWorker
    from worker_service.kv_cache import make_spec

    cfg = read_model_config(rope_model)
    spec = make_spec(cfg, 16, torch.float32)
    dependent = cfg.rope.rope_type in ("dynamic", "longrope")
    assert spec.length_dependent_rope == dependent

    class SpecWorker(FakeWorker):
        def get_kv_cache_spec(self) -> KVCacheSpec:
            return dataclasses.replace(super().get_kv_cache_spec(), length_dependent_rope=dependent)

    engine = EngineCore(SchedulerConfig(), CacheConfig(enable_prefix_caching=True), [SpecWorker()])
    assert engine.scheduler.kv.enable_prefix_caching == (not dependent)
