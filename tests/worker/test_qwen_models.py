"""Acceptance 5: tiny random-weight Qwen2 / Qwen3 checkpoints, built in the test, give the same
logits through the worker (prompt logprobs, chunked prefill, decode) as HF's own implementation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.config import ModelConfig, WorkerConfig
from services.step_types import CachedRequestData, NewRequestData, SchedulerOutput
from services.types import SamplingParams
from tests.hf_reference import hf_greedy, hf_logits
from worker_service.worker import Worker

TINY: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


def _save_tiny(kind: str, path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model: Any
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    else:  # head_dim deliberately != hidden / heads, untied head
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False))
    with torch.no_grad():  # HF zero-inits biases and sets norms to 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(request.param, tmp_path_factory.mktemp(request.param))


def _worker(path: Path) -> Worker:
    config = WorkerConfig(model=ModelConfig(model=str(path), dtype="float32"), max_num_seqs=4)
    worker = Worker(config)
    worker.initialize_cache(32)
    return worker


PROMPT = [(7 * i + 3) % 320 for i in range(40)]


def test_prompt_logprobs_match_hf(tiny_model: Path) -> None:
    worker = _worker(tiny_model)
    params = SamplingParams(temperature=0.0, prompt_logprobs=5, logprobs=5, max_tokens=4)
    new = NewRequestData("q", PROMPT, sampling_params=params, block_ids=list(range(3)))
    out = worker.execute_model(SchedulerOutput(1, [new], CachedRequestData(), {"q": 40}, 40))
    ref = torch.log_softmax(hf_logits(tiny_model, PROMPT), dim=-1)  # [40, V]
    (plp,) = out.prompt_logprobs
    assert plp.start == 1 and len(plp.logprobs) == 39
    for j, entry in enumerate(plp.logprobs):  # entry j: prompt token j + 1 given tokens <= j
        assert entry.token_id == PROMPT[j + 1]
        assert entry.logprob == pytest.approx(ref[j, PROMPT[j + 1]].item(), abs=1e-4)
        top = ref[j].topk(5)
        assert entry.top_token_ids == top.indices.tolist()
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    assert out.sampled_token_ids == [int(ref[-1].argmax())]
    (sampled,) = out.sampled_logprobs
    assert sampled.request_id == "q" and len(sampled.logprobs) == 1
    assert sampled.logprobs[0].logprob == pytest.approx(ref[-1].max().item(), abs=1e-4)
    assert sampled.logprobs[0].rank == 1


def test_chunked_prefill_and_decode_match_hf_generate(tiny_model: Path) -> None:
    worker = _worker(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    new = NewRequestData("g", PROMPT, sampling_params=params, block_ids=[5, 2])
    out = worker.execute_model(SchedulerOutput(1, [new], CachedRequestData(), {"g": 25}, 25))
    assert out.req_ids == ["g"] and out.num_sampled == [0]  # mid-prefill
    out = worker.execute_model(
        SchedulerOutput(2, [], CachedRequestData.of([("g", 25, [9, 1])]), {"g": 15}, 15)
    )
    tokens = list(out.sampled_token_ids)
    for step in range(7):
        cached = CachedRequestData.of([("g", 40 + step, [])])
        tokens += worker.execute_model(
            SchedulerOutput(3 + step, [], cached, {"g": 1}, 1)
        ).sampled_token_ids
    assert tokens == hf_greedy(tiny_model, [PROMPT], 8, "float32")[0]
