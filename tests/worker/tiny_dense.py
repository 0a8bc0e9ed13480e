"""Tiny random-weight HF checkpoints of the dense families, built in-process, and the greedy
parity check every dense-family test runs: Tessera's worker (driven like a scheduler by
tests/worker/driver.py, whole and chunked prefill) against HF `generate` in float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.config import CacheConfig, ModelConfig, WorkerConfig
from services.types import SamplingParams
from tests.hf_reference import hf_greedy, hf_model
from tests.worker.driver import DriverRequest, MiniScheduler
from worker_service.worker import Worker

VOCAB = 320
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
PROMPT_LENS = (5, 17, 30, 33, 47, 64, 71, 100)  # across the small lengths the configs set
NEW_TOKENS = 32
BUDGETS = {"whole": 4096, "chunked": 16}  # tokens per step: one prefill, or 16-token chunks


def eight_prompts() -> list[list[int]]:
    """Eight deterministic prompts of PROMPT_LENS tokens."""
    return [[(7 * i + 13 * k + 3) % VOCAB for i in range(n)] for k, n in enumerate(PROMPT_LENS)]


def save_tiny(model_type: str, path: Path, **overrides: Any) -> Path:
    """A random `model_type` checkpoint (TINY shapes + overrides) at `path`; norms and biases
    are perturbed so that they matter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(path)
    return path


def tessera_greedy(
    path: Path, prompts: list[list[int]], budget: int, num_blocks: int = 128
) -> tuple[list[list[int]], MiniScheduler]:
    """Greedy outputs of the worker on `path` (float32), `budget` tokens per step."""
    config = WorkerConfig(
        model=ModelConfig(model=str(path), dtype="float32"),
        cache=CacheConfig(block_size=16),
        max_num_seqs=8,
        attention_backend="cpu",
    )
    worker = Worker(config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sched = MiniScheduler(worker, num_blocks, 16, budget, NEW_TOKENS)
    for k, prompt in enumerate(prompts):
        sched.add(DriverRequest(f"r{k}", prompt, params))
    outputs = sched.run()
    worker.shutdown()
    return [outputs[f"r{k}"] for k in range(len(prompts))], sched


def hf_reference(
    path: Path, prompts: list[list[int]], attn_implementation: str = "sdpa"
) -> list[list[int]]:
    """HF greedy outputs, each prompt from a fresh rotary state (HF's dynamic rope keeps the
    longest length it has seen between generate calls; a fresh model would not)."""
    model = hf_model(path, "float32", attn_implementation)
    rotary = model.model.rotary_emb
    results = []
    for prompt in prompts:
        if hasattr(rotary, "original_inv_freq"):
            rotary.register_buffer("inv_freq", rotary.original_inv_freq.clone(), persistent=False)
            rotary.max_seq_len_cached = rotary.original_max_seq_len
        results += hf_greedy(path, [prompt], NEW_TOKENS, "float32", attn_implementation)
    return results


def assert_parity(path: Path, budget: int, attn_implementation: str = "sdpa") -> MiniScheduler:
    """Tessera greedy == HF greedy on the eight prompts; returns the driver (its stats)."""
    prompts = eight_prompts()
    got, sched = tessera_greedy(path, prompts, budget)
    expected = hf_reference(path, prompts, attn_implementation)
    for k, (g, e) in enumerate(zip(got, expected, strict=True)):
        first = next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), None)
        assert g == e, f"prompt {k} ({len(prompts[k])} tokens) diverges at token {first}"
    return sched
