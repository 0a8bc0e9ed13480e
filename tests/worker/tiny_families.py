"""One tiny random checkpoint per text-only architecture of the model registry (issue 22),
with the default model's tokenizer so that `LLM` and `tessera serve` load it, and the greedy
tokens HF `generate` gives for its eight prompts (float32, 32 tokens each). Windows are set
far below the prompt lengths: Mistral and Phi-3 window every layer (their out-of-window
blocks are freed), Qwen2 from `max_window_layers` on, Gemma 2/3 every other layer."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.worker.test_dense_families import FAMILIES
from tests.worker.test_gemma import MODELS as GEMMA
from tests.worker.test_sliding_window import WINDOWED
from tests.worker.tiny_dense import eight_prompts, hf_reference, save_tiny
from tests.worker.tiny_moe import ARCHITECTURES as MOE
from tests.worker.tiny_moe import PROMPTS as MOE_PROMPTS
from tests.worker.tiny_moe import save_tiny_moe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Family:
    """How to build one architecture's tiny checkpoint and check it."""

    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "sdpa"  # of the HF reference (Gemma's soft-capping: eager)


DENSE: dict[str, Family] = {
    "llama": Family("llama"),
    "mistral": Family("mistral", WINDOWED["mistral"][1]),
    "qwen2": Family("qwen2", WINDOWED["qwen2"][1]),
    "qwen3": Family("qwen3", dict(head_dim=32)),  # head_dim != hidden / heads
    "phi3": Family("phi3", dict(FAMILIES["phi3"][1], sliding_window=20)),  # longrope too
    "smollm3": Family("smollm3", FAMILIES["smollm3"][1]),
    "gemma2": Family("gemma2", GEMMA["gemma2"][1], "eager"),
    "gemma3": Family("gemma3_text", GEMMA["gemma3"][1], "eager"),
}
ALL_FAMILIES = (*DENSE, *MOE)
ALL_WINDOWED = ("mistral", "phi3")  # every layer windowed: the KV spec carries the window


def save_family(name: str, path: Path, default_model_dir: Path) -> Path:
    """The tiny `name` checkpoint at `path`, with the default model's tokenizer."""
    if name in MOE:
        return save_tiny_moe(name, path, default_model_dir)
    family = DENSE[name]
    save_tiny(family.model_type, path, **family.overrides)
    for file in TOKENIZER_FILES:  # ids < 320 are real tokens of the default model's tokenizer
        shutil.copy(default_model_dir / file, path / file)
    return path


def family_prompts(name: str) -> list[list[int]]:
    """The eight prompts `name` is checked on (5..100 tokens; MoE: 1..61 tokens)."""
    return MOE_PROMPTS if name in MOE else eight_prompts()


def family_reference(name: str, path: Path) -> list[list[int]]:
    """HF greedy tokens of `family_prompts(name)` on the checkpoint at `path`."""
    attn = DENSE[name].attn_implementation if name in DENSE else "sdpa"
    return hf_reference(path, family_prompts(name), attn)
